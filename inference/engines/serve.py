"""``python -m inference.engines.serve ARGS``: vLLM's OpenAI-compatible server
with every route behind its API key.

vLLM 0.32 checks ``--api-key`` / ``VLLM_API_KEY`` only on paths under
``/v1``, ``/v2``, ``/inference`` and ``/cohere``
(``vllm/entrypoints/serve/middleware/authenticate.py``, ``GUARDED_PREFIX``).
The routes a local engine needs beside them (``/reset_prefix_cache``,
``/server_info``, ``/tokenize``, ``/metrics``, ``/version``) and the ones
development mode adds (``/sleep``, ``/pause``, ``/collective_rpc``...) answer
anyone who reaches the port: any local user could sleep, reset or pause an
engine, or send it requests under a salt of its choosing. This entry point
guards every path (``GUARDED_PREFIX = ("/",)``), then runs vLLM's own
``main()`` with the same arguments; the key comes from ``VLLM_API_KEY`` in the
environment (never the command line, which every local user can read in
``/proc``).

The engine core process vLLM spawns imports this module again as its main
module: the patch is module-level, so it holds there too (it changes nothing
there; the HTTP server lives in this process).

vLLM's CPU platform sets ``VLLM_WORKER_MULTIPROC_METHOD=spawn`` while it
checks the configuration (``vllm/platforms/cpu.py``), whatever the deployment
set. Where the launcher asked for ``fork`` (``EngineSpec.start_method``), this
module sets it back right after that check, in the server and in the engine
core: both then fork their children instead of starting interpreters that
import vLLM and torch again.
"""

from __future__ import annotations

import os

import vllm.entrypoints.serve.middleware.authenticate as authenticate
import vllm.platforms.cpu as cpu_platform

authenticate.GUARDED_PREFIX = ("/",)  # type: ignore[assignment]

if os.environ.get("VLLM_WORKER_MULTIPROC_METHOD") == "fork":
    _check_and_update_config = cpu_platform.CpuPlatform.check_and_update_config.__func__  # type: ignore[attr-defined]

    def _keep_fork(cls: type, vllm_config: object) -> None:
        """vLLM's check, then the start method the launcher asked for."""
        _check_and_update_config(cls, vllm_config)
        os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "fork"

    cpu_platform.CpuPlatform.check_and_update_config = classmethod(_keep_fork)  # type: ignore[method-assign,assignment]

if __name__ == "__main__":
    from vllm.entrypoints.launchers.api_server.entry import main

    main()  # type: ignore[no-untyped-call]  # unannotated in vLLM
