"""The embedder's ONNX Runtime backend: the model's transformer exported once per host, then run without torch.

A sentence-transformers model directory such as all-MiniLM-L6-v2's lists its
modules in ``modules.json``: a Transformer (here a BertModel: input_ids,
attention_mask, token_type_ids -> last_hidden_state), a Pooling module
(``1_Pooling/config.json``: mean over the tokens the attention mask keeps) and
a Normalize module (L2). :class:`OnnxSentenceModel` does the same with the
model's own fast tokenizer (``tokenizer.json``, truncated at the model's
``max_seq_length`` and padded to the longest text of a batch, as
sentence-transformers pads), the transformer run by ONNX Runtime, and the
pooling and normalization in numpy.

The transformer is exported with torch's TorchScript exporter
(``torch.onnx.export(..., dynamo=False)``, which needs the ``onnx`` package)
into a folder of local state, under a name derived from the model id, the
model directory and the versions of torch, transformers and onnxruntime: a
later load on the same host and versions reuses the file without importing
torch. Beside it a manifest (written last, as the commit mark) holds the
file's SHA-256 and the torch backend's vectors of a few probe texts; a load
rebuilds the file when the manifest is missing or unreadable, the digest
differs, or the probes no longer match, so a truncated or altered file is
replaced, never trusted. Files are written to a temporary name and moved in
place with ``os.replace``; an ``flock`` on a lock file keeps two processes of
one host (the gateway's workers) from exporting at once.

With ``quantize=True`` the loader derives a second file from that export: its
weights quantized to int8 by ONNX Runtime's dynamic quantization
(:data:`QUANTIZATION`: per output channel, weight MatMuls only, the feed-forward
output projections left in float32), stored and checked the same way; when it is
made, its vectors of the labelled set's texts must be within
:data:`QUANTIZED_COSINE` of the float32 export's.
Measured on the 2-core development host over the 559 texts of the labelled
set (bench/semantic_lookup.py, "backends"): minimum cosine 0.993 to float32,
one query 0.6-0.7x the float32 call's time, precision and recall of the
labelled set unchanged; quantizing the feed-forward outputs too (their inputs
follow the GELU, with a long tail) or per tensor dropped the minimum to
0.94-0.985.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.metadata
import json
import logging
import os
import tempfile
import warnings
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

log = logging.getLogger(__name__)

#: Vectors of two backends (or of a stored export and a fresh run) count as equal at this cosine or above.
EQUAL_COSINE = 0.9999
#: Bump when the exported graph or the manifest changes meaning: older files are then rebuilt.
EXPORT_FORMAT = 1
#: ONNX opset of the export (ONNX Runtime 1.17+ runs it).
OPSET = 17
#: Probe texts embedded by both backends at export time, and by the stored export at every load: a batch with
#: padding, non-ASCII text, an empty text and one past the 256-word-piece truncation.
PROBE_TEXTS = (
    "How do I reset my password?",
    "",
    "Ünïcödé — 日本語のテキスト 🙂",
    "semantic cache " * 200,
)
_INPUTS = ("input_ids", "attention_mask", "token_type_ids")
#: Vectors of the int8 model count as the float32 model's answers at this cosine or above, for every text of
#: :data:`LABELLED_TEXTS` (the questions the semantic cache is judged on; the probes' empty text reaches 0.984,
#: and an empty question is never looked up).
QUANTIZED_COSINE = 0.99
#: The labelled set of bench/semantic_eval.py: its texts check an int8 model once, when it is made.
LABELLED_TEXTS = Path(__file__).resolve().parent / "data" / "pairs.jsonl"
#: How the int8 file is made (part of its key: a change rebuilds it). Names are ``quantize_dynamic``'s arguments.
QUANTIZATION: dict[str, Any] = {
    "method": "dynamic",
    "weight_type": "QInt8",
    "per_channel": True,
    "matmul_const_b_only": True,
    "float_nodes": "feed-forward output projections",
    "texts_per_forward_pass": 1,
}


class OnnxBackendError(RuntimeError):
    """The ONNX backend cannot be used here (onnxruntime or the exporter missing, export or check failed)."""


def default_onnx_dir() -> Path:
    """The folder of exported models when none is given: ``<temp dir>/gateway-embedder-<uid>`` (owner only)."""
    return Path(tempfile.gettempdir()) / f"gateway-embedder-{os.getuid()}"


def _private_dir(path: Path) -> Path:
    """Create ``path`` owner-only; refuse one that another user owns or others may write (it holds code we run)."""
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    st = path.stat()
    if st.st_uid != os.getuid():
        raise OnnxBackendError(f"{path} belongs to uid {st.st_uid}, not to this process's {os.getuid()}")
    if st.st_mode & 0o022:
        path.chmod(st.st_mode & ~0o022)
    return path


def _version(distribution: str) -> str:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return "absent"


def export_key(model_dir: Path, model_id: str) -> tuple[str, dict[str, Any]]:
    """The file stem of the export of ``model_dir`` and what it was derived from (stored in the manifest)."""
    identity: dict[str, Any] = {
        "format": EXPORT_FORMAT,
        "opset": OPSET,
        "model_id": model_id,
        "model_dir": str(model_dir.resolve()),
        "torch": _version("torch"),
        "transformers": _version("transformers"),
        "onnxruntime": _version("onnxruntime"),
    }
    digest = hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:16]
    safe = "".join(c if c.isalnum() or c in "-_.=@" else "_" for c in model_id)[:80]
    return f"{safe}-{digest}", identity


def config_int(path: Path, key: str, error: type[Exception]) -> int:
    """A positive integer ``key`` of a model's JSON config file.

    Raises:
        error: the file is unreadable, not JSON, lacks ``key``, or its value is not an integer > 0.
    """
    try:
        value = json.loads(path.read_text(encoding="utf-8"))[key]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise error(f"cannot read {key} from {path}: {exc}") from exc
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise error(f"{path}: {key} must be a positive integer, got {value!r}")
    return value


def _max_seq_length(model_dir: Path) -> int:
    return config_int(model_dir / "sentence_bert_config.json", "max_seq_length", OnnxBackendError)


def _check_modules(model_dir: Path) -> None:
    """Refuse a model whose modules or pooling this backend does not reproduce (it would embed differently)."""
    try:
        modules = json.loads((model_dir / "modules.json").read_text(encoding="utf-8"))
        pooling = json.loads((model_dir / "1_Pooling" / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise OnnxBackendError(f"cannot read the modules of {model_dir}: {exc}") from exc
    kinds = [str(m.get("type", "")).rsplit(".", 1)[-1] for m in modules] if isinstance(modules, list) else None
    if kinds not in (["Transformer", "Pooling", "Normalize"], ["Transformer", "Pooling"]):
        raise OnnxBackendError(f"{model_dir}: modules {kinds} are not Transformer, Pooling[, Normalize]")
    modes = {k for k, v in pooling.items() if k.startswith("pooling_mode") and v is True} if isinstance(pooling, dict) else None
    if modes != {"pooling_mode_mean_tokens"}:
        raise OnnxBackendError(f"{model_dir}: pooling {sorted(modes or [])} is not mean pooling alone")


class OnnxSentenceModel:
    """A sentence-embedding model run by ONNX Runtime, with the ``encode`` call the embedder makes of sentence-transformers.

    Args:
        session: an ``onnxruntime.InferenceSession`` of the exported transformer.
        tokenizer: the model's ``tokenizers.Tokenizer``.
        max_seq_length: word pieces kept per text (special tokens included).
        max_batch: texts per forward pass at most, whatever ``encode`` is asked; 1 for the int8 model, whose
            activations are quantized with one scale per input tensor: batched with other texts, a text's
            vector would depend on its companions (a similarity moved by 0.01 in a test), alone it is a
            function of the text.
    """

    def __init__(self, session: Any, tokenizer: Any, max_seq_length: int, max_batch: int | None = None) -> None:
        self.session = session
        self.max_batch = max_batch
        self.tokenizer = tokenizer
        self.max_seq_length = max_seq_length
        # Once, here (a tokenizer reconfigured while another thread encodes raises "Already borrowed").
        # tokenizer.json asks for truncation at 128 and padding to 128: sentence-transformers truncates at the
        # model's max_seq_length and pads a batch to its longest text, which encode() does itself.
        tokenizer.enable_truncation(max_length=max_seq_length)
        tokenizer.no_padding()

    def encode(
        self,
        texts: Sequence[str],
        batch_size: int = 64,
        show_progress_bar: bool = False,
        convert_to_numpy: bool = True,
        normalize_embeddings: bool = True,
    ) -> np.ndarray:
        """Embed ``texts``: float32 (n, dim), L2-normalized rows, row i for ``texts[i]``.

        Texts are batched longest first, as sentence-transformers batches
        them (less padding); the other keyword arguments exist for the
        caller's sake (no progress bar, numpy out, rows always normalized).
        """
        if len(texts) == 0:
            return np.zeros((0, 0), dtype=np.float32)
        if self.max_batch is not None:
            batch_size = min(batch_size, self.max_batch)
        encodings = self.tokenizer.encode_batch(list(texts), add_special_tokens=True)
        order = sorted(range(len(texts)), key=lambda i: -len(encodings[i].ids))
        out: np.ndarray | None = None
        for start in range(0, len(order), batch_size):
            chosen = order[start : start + batch_size]
            width = max(len(encodings[i].ids) for i in chosen)
            feeds = {name: np.zeros((len(chosen), width), dtype=np.int64) for name in _INPUTS}
            for row, i in enumerate(chosen):
                enc = encodings[i]
                n = len(enc.ids)
                feeds["input_ids"][row, :n] = enc.ids
                feeds["attention_mask"][row, :n] = enc.attention_mask
                feeds["token_type_ids"][row, :n] = enc.type_ids
            vectors = self.pool(self.session.run(None, feeds)[0], feeds["attention_mask"])
            if out is None:
                out = np.empty((len(texts), vectors.shape[1]), dtype=np.float32)
            out[chosen] = vectors
        assert out is not None
        return out

    @staticmethod
    def pool(hidden: np.ndarray, attention_mask: np.ndarray) -> np.ndarray:
        """Mean of the kept tokens' states, then L2 normalization (sentence-transformers' Pooling and Normalize)."""
        mask = attention_mask[..., None].astype(np.float32)
        summed = (hidden.astype(np.float32) * mask).sum(axis=1)
        mean = summed / np.maximum(mask.sum(axis=1), np.float32(1e-9))
        norms = np.linalg.norm(mean, axis=1, keepdims=True)
        normalized: np.ndarray = (mean / np.maximum(norms, np.float32(1e-12))).astype(np.float32)
        return normalized


def feed_forward_outputs(graph: Any) -> list[str]:
    """Names of the MatMul nodes of a BERT export's feed-forward output projections (``.../output/dense/MatMul``
    of each layer, not the attention's ``.../attention/output/dense``): the ones int8 quantization leaves in float32.

    Their input is the GELU of the intermediate projection, whose long tail quantizes worst: with them in int8
    the minimum cosine to float32 over the labelled set fell from 0.993 to 0.985 (bench/semantic_lookup.py).
    """
    return [
        node.name
        for node in graph.graph.node
        if node.op_type == "MatMul" and "/output/dense/" in node.name and "/attention/" not in node.name
    ]


def _min_cosine(a: np.ndarray, b: np.ndarray) -> float:
    if a.shape != b.shape:
        return -1.0
    a64, b64 = a.astype(np.float64), b.astype(np.float64)
    cos = (a64 * b64).sum(axis=1) / np.maximum(np.linalg.norm(a64, axis=1) * np.linalg.norm(b64, axis=1), 1e-12)
    return float(cos.min())


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    with open(path, "a+b") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _write_atomically(path: Path, data: bytes) -> None:
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


class OnnxLoader:
    """Finds, checks, exports and opens the ONNX form of one model directory.

    Args:
        model_dir: the sentence-transformers model directory.
        model_id: the embedder's model id (part of the file's key).
        onnx_dir: the folder of exports; default :func:`default_onnx_dir`.
        threads: ONNX Runtime's intra-op threads (None: its default, one per core).
        quantize: :meth:`load` returns the int8 model derived from the float32 export (:data:`QUANTIZATION`).

    Attributes:
        exported: True when the last :meth:`load` exported the model (False: it reused the stored file).
        quantized: True when the last :meth:`load` quantized the export (False: it reused the stored int8 file).
        torch_model: after an export, the SentenceTransformer it exported from (the caller may fall back to it).
        float_model: the float32 ONNX model once loaded (the caller may fall back to it when quantizing fails).
    """

    def __init__(
        self, model_dir: Path, model_id: str, onnx_dir: Path | None = None, threads: int | None = 1, *, quantize: bool = False
    ) -> None:  # fmt: skip
        self.model_dir = model_dir
        self.model_id = model_id
        self.onnx_dir = onnx_dir if onnx_dir is not None else default_onnx_dir()
        self.threads = threads
        self.quantize = quantize
        stem, self.identity = export_key(model_dir, model_id)
        self.onnx_path = self.onnx_dir / f"{stem}.onnx"
        self.manifest_path = self.onnx_dir / f"{stem}.json"
        self.lock_path = self.onnx_dir / f"{stem}.lock"
        self.int8_identity: dict[str, Any] = {**self.identity, "quantization": QUANTIZATION}
        self.int8_path = self.onnx_dir / f"{stem}-int8.onnx"
        self.int8_manifest_path = self.onnx_dir / f"{stem}-int8.json"
        self.exported = False
        self.quantized = False
        self.torch_model: Any = None
        self.float_model: OnnxSentenceModel | None = None
        self._float_bytes: bytes | None = None

    def load(self) -> OnnxSentenceModel:
        """The model run by ONNX Runtime: the stored export if it checks out, a fresh export otherwise;
        with ``quantize``, then the stored int8 file if it checks out, a fresh quantization otherwise.

        Raises:
            OnnxBackendError: onnxruntime or tokenizers missing, an unsupported model, an export that fails
                or whose vectors differ from torch's, or a quantization that fails or whose vectors are not
                within :data:`QUANTIZED_COSINE` of the float32 model's (:attr:`float_model` is then set).
        """
        try:
            import onnxruntime
            from tokenizers import Tokenizer
        except ImportError as exc:
            raise OnnxBackendError(f"onnxruntime is not available: {exc}") from exc
        _check_modules(self.model_dir)
        max_seq_length = _max_seq_length(self.model_dir)
        try:
            tokenizer = Tokenizer.from_file(str(self.model_dir / "tokenizer.json"))
        except Exception as exc:  # noqa: BLE001 - the Rust tokenizer raises its own exception types
            raise OnnxBackendError(f"cannot read {self.model_dir / 'tokenizer.json'}: {exc}") from exc
        try:
            _private_dir(self.onnx_dir)
        except OSError as exc:
            raise OnnxBackendError(f"cannot create {self.onnx_dir}: {exc}") from exc
        model = self._stored(onnxruntime, tokenizer, max_seq_length)
        if model is None:
            with _locked(self.lock_path):
                model = self._stored(onnxruntime, tokenizer, max_seq_length)  # another process may have exported meanwhile
                if model is None:
                    model = self._export(onnxruntime, tokenizer, max_seq_length)
        self.float_model = model
        if not self.quantize:
            return model
        int8 = self._stored(onnxruntime, tokenizer, max_seq_length, int8=True)
        if int8 is not None:
            return int8
        with _locked(self.lock_path):
            int8 = self._stored(onnxruntime, tokenizer, max_seq_length, int8=True)
            return int8 if int8 is not None else self._quantize(onnxruntime, tokenizer, max_seq_length, model)

    def _session(self, onnxruntime: Any, data: bytes) -> Any:
        options = onnxruntime.SessionOptions()
        options.intra_op_num_threads = self.threads or 0
        options.inter_op_num_threads = 1
        options.execution_mode = onnxruntime.ExecutionMode.ORT_SEQUENTIAL
        options.log_severity_level = 3
        return onnxruntime.InferenceSession(data, options, providers=["CPUExecutionProvider"])

    def _stored(self, onnxruntime: Any, tokenizer: Any, max_seq_length: int, *, int8: bool = False) -> OnnxSentenceModel | None:
        """The stored export (``int8``: the stored int8 file) if its manifest, digest and probe vectors check out,
        else None (logged)."""
        onnx_path, manifest_path = (self.int8_path, self.int8_manifest_path) if int8 else (self.onnx_path, self.manifest_path)
        identity = self.int8_identity if int8 else self.identity
        try:
            manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
            data = onnx_path.read_bytes()
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as exc:
            log.warning("embedder: stored ONNX export %s unreadable (%s); exporting again", onnx_path, exc)
            return None
        problem = None
        if not isinstance(manifest, dict) or manifest.get("identity") != identity:
            problem = "its manifest is not this model's"
        elif hashlib.sha256(data).hexdigest() != manifest.get("sha256"):
            problem = "its SHA-256 differs from the manifest's"
        if problem is None:
            try:
                model = OnnxSentenceModel(self._session(onnxruntime, data), tokenizer, max_seq_length, 1 if int8 else None)
                got = model.encode(list(PROBE_TEXTS))
                want = np.asarray(manifest["probe_vectors"], dtype=np.float32)
            except Exception as exc:  # noqa: BLE001 - ONNX Runtime raises its own exception types
                problem = f"it does not run ({exc})"
            else:
                if _min_cosine(got, want) >= EQUAL_COSINE:
                    if int8:
                        self.quantized = False
                    else:
                        self.exported = False
                        self._float_bytes = data
                    return model
                problem = "its probe vectors differ from the ones it was stored with"
        log.warning("embedder: stored ONNX export %s not used: %s; exporting again", onnx_path, problem)
        return None

    def _export(self, onnxruntime: Any, tokenizer: Any, max_seq_length: int) -> OnnxSentenceModel:
        """Export the transformer, check it against torch on the probes, store it with its manifest."""
        try:
            import torch
            from sentence_transformers import SentenceTransformer

            if self.threads is not None:
                torch.set_num_threads(self.threads)  # process-wide, as the torch backend sets it
            st_model = SentenceTransformer(str(self.model_dir), device="cpu", local_files_only=True)
            st_model.eval()
            self.torch_model = st_model
            transformer = st_model[0].auto_model
            want = np.asarray(
                st_model.encode(list(PROBE_TEXTS), convert_to_numpy=True, normalize_embeddings=True), dtype=np.float32
            )
            data = self._trace(torch, transformer)
        except Exception as exc:  # noqa: BLE001 - whatever torch's exporter raises, the backend is unavailable
            raise OnnxBackendError(f"exporting {self.model_dir} to ONNX failed: {exc}") from exc
        try:
            model = OnnxSentenceModel(self._session(onnxruntime, data), tokenizer, max_seq_length)
            got = model.encode(list(PROBE_TEXTS))
        except Exception as exc:  # noqa: BLE001 - ONNX Runtime raises its own exception types
            raise OnnxBackendError(f"ONNX Runtime cannot run the export of {self.model_dir}: {exc}") from exc
        cosine = _min_cosine(got, want)
        if cosine < EQUAL_COSINE:
            raise OnnxBackendError(f"the ONNX export of {self.model_dir} embeds differently (min cosine {cosine:.6f})")
        manifest = {
            "identity": self.identity,
            "sha256": hashlib.sha256(data).hexdigest(),
            "probe_vectors": got.tolist(),
            "probe_min_cosine_to_torch": cosine,
        }
        self._store(self.onnx_path, self.manifest_path, data, manifest, what="ONNX export")
        self.exported = True
        self._float_bytes = data
        return model

    def _quantize(
        self, onnxruntime: Any, tokenizer: Any, max_seq_length: int, float_model: OnnxSentenceModel
    ) -> OnnxSentenceModel:
        """Quantize the float32 export (:data:`QUANTIZATION`), check it against it on the labelled texts, store it."""
        assert self._float_bytes is not None, "the float32 export is loaded first"
        try:
            import onnx
            from onnxruntime.quantization import QuantType, quantize_dynamic

            graph = onnx.load_from_string(self._float_bytes)
            keep_float = feed_forward_outputs(graph)
            with tempfile.TemporaryDirectory(dir=self.onnx_dir) as scratch:
                source, target = Path(scratch) / "float.onnx", Path(scratch) / "int8.onnx"
                source.write_bytes(self._float_bytes)
                quantize_dynamic(
                    source, target, weight_type=QuantType.QInt8, per_channel=True, nodes_to_exclude=keep_float,
                    extra_options={"MatMulConstBOnly": True},
                )  # fmt: skip
                data = target.read_bytes()
            model = OnnxSentenceModel(self._session(onnxruntime, data), tokenizer, max_seq_length, max_batch=1)
            rows = [json.loads(line) for line in LABELLED_TEXTS.read_text(encoding="utf-8").splitlines() if line.strip()]
            texts = list(dict.fromkeys(text for row in rows for text in (row["a"], row["b"])))
            cosine = _min_cosine(model.encode(texts), float_model.encode(texts))
            got = model.encode(list(PROBE_TEXTS))
        except Exception as exc:  # noqa: BLE001 - the quantizer and ONNX Runtime raise their own exception types
            raise OnnxBackendError(f"quantizing the ONNX export of {self.model_dir} failed: {exc}") from exc
        if cosine < QUANTIZED_COSINE:
            raise OnnxBackendError(f"the int8 model of {self.model_dir} embeds too differently (min cosine {cosine:.4f})")
        manifest = {
            "identity": self.int8_identity,
            "sha256": hashlib.sha256(data).hexdigest(),
            "probe_vectors": got.tolist(),
            "labelled_min_cosine_to_float": cosine,
        }
        self._store(self.int8_path, self.int8_manifest_path, data, manifest, what="int8 model")
        self.quantized = True
        return model

    def _store(self, path: Path, manifest_path: Path, data: bytes, manifest: dict[str, Any], *, what: str) -> None:
        """Write a model file, then its manifest (last: the commit mark), each atomically; a folder
        that cannot be written leaves the model to this process alone, with a warning naming ``what``."""
        try:
            _write_atomically(path, data)
            _write_atomically(manifest_path, json.dumps(manifest).encode())
        except OSError as exc:
            log.warning("embedder: %s not stored in %s (%s); used in this process only", what, self.onnx_dir, exc)

    def _trace(self, torch: Any, transformer: Any) -> bytes:
        """The transformer (input ids, attention mask, token types → last hidden state) as ONNX bytes."""
        # An example with padding, so the traced graph keeps the attention mask's every use.
        rows = ([[101, 2019, 2742, 102], [101, 102, 0, 0]], [[1, 1, 1, 1], [1, 1, 0, 0]], [[0] * 4] * 2)
        example = tuple(torch.tensor(r, dtype=torch.int64) for r in rows)

        class LastHiddenState(torch.nn.Module):  # type: ignore[misc]
            def __init__(self, inner: Any) -> None:
                super().__init__()
                self.inner = inner

            def forward(self, input_ids: Any, attention_mask: Any, token_type_ids: Any) -> Any:
                out = self.inner(input_ids=input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids)
                return out.last_hidden_state

        axes = {name: {0: "batch", 1: "sequence"} for name in (*_INPUTS, "last_hidden_state")}
        with tempfile.TemporaryDirectory(dir=self.onnx_dir) as scratch:
            target = Path(scratch) / "model.onnx"
            # The tracer's warnings name branches on shapes that hold for every input here (the probes check).
            with torch.no_grad(), warnings.catch_warnings():
                warnings.simplefilter("ignore")
                torch.onnx.export(
                    LastHiddenState(transformer), example, str(target), dynamo=False, input_names=list(_INPUTS),
                    output_names=["last_hidden_state"], dynamic_axes=axes, opset_version=OPSET,
                )  # fmt: skip
            return target.read_bytes()
