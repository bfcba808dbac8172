"""How long an idle HTTP/1.1 connection is kept, on each end of the project's connections.

A kept-alive connection is closed by whichever end's idle time runs out first. When
the server closes it just as the client sends the next request on it, that request
fails with no answer (httpx: ``RemoteProtocolError: Server disconnected without
sending a response``), and the client cannot tell whether it ran. Clients avoid this
by giving up an idle connection well before the server would, so:

- the servers this project runs keep idle connections long: the gateway
  (``GATEWAY_KEEPALIVE_S``, uvicorn's ``timeout_keep_alive``) and the engines it
  starts (vLLM's ``VLLM_HTTP_TIMEOUT_KEEP_ALIVE``, vllm/envs.py), both
  :data:`SERVER_IDLE_S` by default. Common clients' idle times are 5 s (httpx,
  and so OpenAI's Python SDK; Node's http agent) or unbounded (urllib3, so
  ``requests``), which would race uvicorn's default of 5 s;
- this project's own clients give up an idle connection after :data:`CLIENT_IDLE_S`,
  well under uvicorn's 5 s default, which an adopted engine may still have.
  A second's margin was not enough on a loaded 2-core machine: a thread that read
  an answer late started its idle clock late (one request in 400 of the demo's
  traffic failed so in CI).
"""

from __future__ import annotations

#: Seconds this project's HTTP clients keep an idle connection (httpx's ``keepalive_expiry``).
#: Under uvicorn's default ``timeout_keep_alive`` (5 s) by 3 s of scheduling delay.
CLIENT_IDLE_S = 2.0
#: Seconds the servers this project runs keep an idle connection: nginx's default ``keepalive_timeout``
#: (https://nginx.org/en/docs/http/ngx_http_core_module.html#keepalive_timeout), far above clients' idle times.
SERVER_IDLE_S = 75
#: The engine's environment variable for its server's keep-alive (vllm/envs.py, default 5).
VLLM_KEEPALIVE_ENV = "VLLM_HTTP_TIMEOUT_KEEP_ALIVE"
