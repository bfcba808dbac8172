"""Probes that learn what an engine *is* from how its prefix cache behaves.

An address says how a server is written, not which server it is: one vLLM
process listening on every interface answers at ``127.0.0.1``, at the host's
LAN address and under any name resolving to either. Adopting it twice under
two spellings lets two tenants' traffic share one prefix cache. Two probes
settle questions no endpoint answers:

- :func:`shares_prefix_cache`: a prompt of a few whole KV blocks sent to a
  known engine under a fresh random salt is cached there; the same prompt and
  salt sent to a candidate report cached tokens only if the candidate reads
  the same cache (it is the same engine, or shares its KV tier).
- :func:`reads_across_salts`: a prompt sent under salt A, then under salt B
  to the same engine; vLLM mixes ``cache_salt`` into the first block's hash
  (``vllm/v1/core/kv_cache_utils.py``, extra keys), so its own prefix cache
  never serves B from A's blocks. Cached tokens under B therefore come from a
  persistent tier that keys KV on token ids alone (vLLM 0.32's
  ExampleConnector, measured here: 640 tokens of another salt's KV loaded).
  Such a tier must never back two namespaces.

Both rely on ``usage.prompt_tokens_details.cached_tokens`` (vLLM's
``--enable-prompt-tokens-details``), which counts tokens from the prefix
cache and from a connector's tier alike.

Probe salts are minted under the control plane's secret (:func:`mint_probe_salt`),
so the KV-event consumer recognises the blocks they leave
(:func:`is_probe_salt`) and raises no isolation alarm for them, while nobody
without the secret can make blocks pass for a probe's.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING

from inference.errors import EngineError

#: Reads under fresh salts before a tier is taken to honour the salt, and the wait between them (s).
READ_ACROSS_ATTEMPTS = 3
READ_ACROSS_WAIT_S = 0.5
#: Fresh prompts drawn, at most, until one's length is off a block edge (see :func:`reads_across_salts`).
EDGE_REDRAWS = 8

if TYPE_CHECKING:
    from inference.engines.vllm_http import VllmHttpClient

#: Every probe salt starts so (vLLM refuses ``@``, ``/``, ``\\`` and NUL in a salt, and more than 128 characters).
PROBE_SALT_PREFIX = "kvcp-probe."
#: Whole KV blocks a probe prompt spans at least (the first block carries the salt).
PROBE_BLOCKS = 3
_WORDS = (
    "amber", "basalt", "cedar", "delta", "ember", "fjord", "garnet", "harbor", "indigo", "juniper", "kestrel", "lagoon",
    "meadow", "nectar", "onyx", "prairie", "quartz", "raven", "sierra", "tundra", "umber", "violet", "willow", "zenith",
)  # fmt: skip


def _mac(secret: str, nonce: str) -> str:
    return hmac.new(secret.encode("utf-8"), f"probe-salt:{nonce}".encode(), hashlib.sha256).hexdigest()[:24]


def mint_probe_salt(secret: str) -> str:
    """A fresh probe salt: ``kvcp-probe.<nonce>.<HMAC of the nonce under secret>`` (57 characters)."""
    nonce = secrets.token_hex(8)
    return f"{PROBE_SALT_PREFIX}{nonce}.{_mac(secret, nonce)}"


def is_probe_salt(secret: str, salt: str) -> bool:
    """Whether ``salt`` was minted by :func:`mint_probe_salt` under ``secret`` (constant-time comparison)."""
    if not salt.startswith(PROBE_SALT_PREFIX):
        return False
    nonce, _, mac = salt[len(PROBE_SALT_PREFIX) :].partition(".")
    return bool(nonce) and hmac.compare_digest(mac, _mac(secret, nonce))


def probe_prompt(block_size: int) -> str:
    """A prompt of more than :data:`PROBE_BLOCKS` whole blocks of ``block_size``
    tokens under any tokenizer (every word is at least one token), random so
    that no earlier request cached it."""
    rng = secrets.SystemRandom()
    words = [rng.choice(_WORDS) + str(rng.randrange(1000)) for _ in range(block_size * (PROBE_BLOCKS + 1))]
    return "Probe " + " ".join(words)


class CachedTokensUnreported(EngineError):
    """The engine answered without ``usage.prompt_tokens_details.cached_tokens``: nothing can be probed."""


def _cached(client: VllmHttpClient, prompt: str, salt: str) -> int:
    cached = client.prompt_cached_tokens(prompt, cache_salt=salt)
    if cached is None:
        raise CachedTokensUnreported(
            f"engine at {client.base_url} does not report cached tokens (start it with --enable-prompt-tokens-details)"
        )
    return cached


def shares_prefix_cache(
    known: VllmHttpClient,
    candidate: VllmHttpClient,
    *,
    secret: str,
    block_size: int,
    prompts: Iterator[str] | None = None,
) -> bool:
    """Whether ``candidate`` reads the prefix cache ``known`` fills (they are one engine, or share a KV tier).

    Args:
        known: an engine with prefix caching on.
        candidate: the engine to tell apart from it.
        secret: the control plane's secret (probe salts are minted under it).
        block_size: the engines' KV block size in tokens.
        prompts: the probe prompts to draw from (default: fresh random ones, :func:`probe_prompt`).

    Returns:
        True when the candidate reported at least one whole block cached for a
        prompt only ``known`` has seen.

    Raises:
        EngineError: an engine did not answer.
        CachedTokensUnreported: the candidate does not report cached tokens.
    """
    salt = mint_probe_salt(secret)
    prompt = _seed(known, salt, block_size, prompts, reported=False)
    return _cached(candidate, prompt, salt) >= block_size


def on_block_edge(length: int, block_size: int) -> bool:
    """Whether a prompt of ``length`` tokens ends on a KV block's edge: a whole
    number of blocks, or one token past it.

    Tiers disagree there on how many blocks a prompt spans. vLLM 0.32's
    ExampleConnector stores a prompt's KV under the hash of its first
    ``(length - 1) // block_size`` blocks and looks it up under the hash of
    ``(length - 2) // block_size`` (``align_to_block_size`` applied to
    ``len`` in ``make_meta``, to ``len - 1`` in ``_found_match_for_prompt``,
    ``vllm/distributed/kv_transfer/kv_connector/v1/example_connector.py``):
    for a length of ``k * block_size + 1`` the two differ, and the tier never
    serves what it stored, to any salt. A prompt of whole blocks loses its
    last block to every cache (the engine computes the last token anew), so
    it is avoided too.
    """
    return length % block_size in (0, 1)


def _fresh_prompts(block_size: int) -> Iterator[str]:
    while True:
        yield probe_prompt(block_size)


def _seed(client: VllmHttpClient, salt: str, block_size: int, prompts: Iterator[str] | None, *, reported: bool) -> str:
    """Cache a probe prompt in ``client`` under ``salt``; the prompt.

    A prompt whose length the engine reports on a block's edge
    (:func:`on_block_edge`) is replaced by a fresh one, up to
    :data:`EDGE_REDRAWS` times, so that no tier is passed for a quirk of
    where it cuts a prompt into blocks.

    Raises:
        EngineError: the engine did not answer.
        CachedTokensUnreported: ``reported`` and the engine does not report cached tokens.
    """
    source = prompts if prompts is not None else _fresh_prompts(block_size)
    for _ in range(EDGE_REDRAWS):
        prompt = next(source)
        length, cached = client.prompt_usage(prompt, cache_salt=salt)
        if reported and cached is None:
            raise CachedTokensUnreported(
                f"engine at {client.base_url} does not report cached tokens (start it with --enable-prompt-tokens-details)"
            )
        if length is None or not on_block_edge(length, block_size):
            break
    return prompt


def reads_across_salts(client: VllmHttpClient, *, secret: str, block_size: int, prompts: Iterator[str] | None = None) -> int:
    """Tokens the engine served under one salt from KV computed under another.

    A prompt is cached under one fresh salt (one off a block's edge,
    :func:`_seed`), then read under another: up to
    :data:`READ_ACROSS_ATTEMPTS` times, :data:`READ_ACROSS_WAIT_S` apart, each
    under a salt of its own, until a read finds KV.

    Args:
        client: the engine, with ``--enable-prompt-tokens-details``.
        secret: the control plane's secret (probe salts are minted under it).
        block_size: the engine's KV block size in tokens.
        prompts: the probe prompts to draw from (default: fresh random ones, :func:`probe_prompt`).

    Returns:
        The cached tokens of the first read that found any (0 for an engine
        whose every tier honours ``cache_salt``).

    Raises:
        EngineError: the engine did not answer, or does not report cached tokens.
    """
    prompt = _seed(client, mint_probe_salt(secret), block_size, prompts, reported=True)
    # A persistent tier may store the first request's KV after its answer (vLLM's connectors save
    # on their own schedule): read it under fresh salts a few times, so a salt-blind tier is not
    # passed because its write had not landed yet.
    for attempt in range(READ_ACROSS_ATTEMPTS):
        across = _cached(client, prompt, mint_probe_salt(secret))
        if across or attempt == READ_ACROSS_ATTEMPTS - 1:
            return across
        time.sleep(READ_ACROSS_WAIT_S)
    return 0
