"""The OpenAI-compatible HTTP front and its Prometheus metrics (``radixserve launch
--http-port``). It is one more client of the tokenizer process; see docs/http.md."""
