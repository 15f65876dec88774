"""An OpenAI-compatible HTTP frontend (`/v1/models`, `/v1/completions`, `/v1/chat/completions`)
in front of tritonserver: FastAPI + uvicorn, talking to the `vllm_model` route over gRPC
streaming (tritonclient's asyncio client).

    .venv/bin/python -m openai_frontend            # port OPENAI_PORT (9000), gRPC GRPC_PORT (8001)

`make serve` starts it beside tritonserver. The chat template and the tokenizer come from the
served checkpoint (TOKENIZER_PATH, else MODEL_PATH, else models/tiny-llama); everything else
(tokenization, stop strings, detokenization, token counts) happens in the server, so the text
is exactly what `vllm_model` returns. See README "OpenAI-compatible endpoint".
"""
