"""The vLLM/OpenAI wire, as servescope reads it: what the load generator, the gateway and the
collector all need to agree on, kept in one room so none of them imports another.

- `stream`: the OpenAI streaming endpoints, the timing rules (TTFT, ITL, TPOT, e2e) and the
  error classes of a failed request;
- `tracing`: one W3C trace per request, carried to vLLM with `traceparent`;
- `ids`: vLLM's request ids back to the client's `X-Request-Id`;
- `vllm_log`: one vLLM server log line → what it tells;
- `kv_statement`: vLLM's start-up statement of its KV-cache capacity;
- `exposition`: Prometheus `/metrics` text → samples, under vLLM's current metric names.
"""
