-- wrk: every request is a small non-streamed OpenAI completion.
wrk.method = "POST"
wrk.headers["Content-Type"] = "application/json"
wrk.body = '{"model":"mock-model","prompt":"The capital of France is","max_tokens":4}'
