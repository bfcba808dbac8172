"""The environment of a child process, built from an allowlist.

A child started with the parent's environment inherits whatever the parent
happens to hold: a vLLM engine started by a gunicorn worker found the control
plane's ``PROMETHEUS_MULTIPROC_DIR``, wrote its ``vllm:`` series into the
control plane's metrics folder and read its own ``cache_config_info`` back
mixed with other processes' (``enable_prefix_caching`` then read False: a
healthy engine was marked drifted). Secrets the parent holds (database
passwords in ``DATABASE_URL``, API keys) would reach engines the same way.

Every child therefore gets the operating system's few names
(:data:`SYSTEM_NAMES`, the ``LC_*`` locale names), the names its starter lists
as its own, and the values its starter sets, nothing else.
"""

from __future__ import annotations

import ctypes
import os
import signal
from collections.abc import Iterable, Mapping

#: What any program expects from its session: the search path, the user, the
#: locale, the temporary folder, the certificate bundle. None of them is a secret
#: or changes what a child computes.
SYSTEM_NAMES = frozenset(
    {
        "PATH", "HOME", "USER", "LOGNAME", "SHELL", "TERM", "LANG", "LANGUAGE", "TZ", "TMPDIR",
        "SSL_CERT_FILE", "SSL_CERT_DIR", "VIRTUAL_ENV",
    }
)  # fmt: skip


#: What every local engine gets from its starter's environment beside the system's
#: names: where its caches live (TorchInductor's compiled kernels, vLLM's and Hugging
#: Face's caches; a cache started anew costs every engine start its compile) and
#: which accelerators it may use. None of them is a secret or changes what it computes.
#: The control plane's own children pass them on too: the worker starts engines.
ENGINE_ENV_NAMES = frozenset({"TORCHINDUCTOR_CACHE_DIR", "VLLM_CACHE_ROOT", "XDG_CACHE_HOME", "HF_HOME", "CUDA_VISIBLE_DEVICES"})


def child_environment(values: Mapping[str, str] | None = None, *, inherit: Iterable[str] = ()) -> dict[str, str]:
    """The environment for a child process.

    Args:
        values: names the starter sets (they win over inherited ones).
        inherit: names the child needs from this process's environment beside
            :data:`SYSTEM_NAMES` (the settings it reads, a GPU's visible devices);
            a name unset here is left unset there.

    Returns:
        name → value: the system names and ``inherit`` as set here, the
        ``LC_*`` locale names, then ``values``.
    """
    wanted = SYSTEM_NAMES.union(inherit)
    env = {name: value for name, value in os.environ.items() if name in wanted or name.startswith("LC_")}
    env.update(values or {})
    return env


#: prctl(2)'s option that sets the signal a child gets when its parent thread ends.
_PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """``preexec_fn`` for child processes that must not outlive their parent.

    Linux ``prctl(PR_SET_PDEATHSIG, SIGTERM)``: a killed demo or test run would
    otherwise leave engines holding GiBs and ports, or a worker consuming jobs.
    """
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
