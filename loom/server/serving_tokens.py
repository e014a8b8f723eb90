"""POST /tokenize, POST /detokenize and GET /tokenizer_info: the model's tokenizer for clients that count or build
prompts themselves (lm-eval's `tokenizer_backend=remote` reads all three)."""

from __future__ import annotations

from loom.engine.client import EngineClient
from loom.server.errors import APIError
from loom.server.protocol import DetokenizeRequest, TokenizeRequest
from loom.server.serving_chat import ChatRenderer


class TokenServing:
    """Plain functions: FastAPI runs them on its worker threads, off the event loop."""

    def __init__(self, client: EngineClient, renderer: ChatRenderer) -> None:
        self.client, self.renderer = client, renderer

    def tokenize(self, body: TokenizeRequest) -> dict:
        if (body.prompt is None) == (body.messages is None):
            raise APIError(400, "give exactly one of prompt or messages", param="prompt")
        tokenizer = self.client.tokenizer
        try:
            if body.messages is not None:
                tokens = tokenizer.encode(self.renderer.render(body), add_special_tokens=False)
            else:
                tokens = tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens)
        except ValueError as e:
            raise APIError(400, str(e)) from e
        return {"tokens": tokens, "count": len(tokens), "max_model_len": self.client.max_model_len}

    def detokenize(self, body: DetokenizeRequest) -> dict:
        vocab = self.client.vocab_size
        if any(not 0 <= t < vocab for t in body.tokens):
            raise APIError(400, f"token ids must be in [0, {vocab})", param="tokens")
        return {"prompt": self.client.tokenizer.decode(body.tokens, skip_special_tokens=False)}

    def tokenizer_info(self) -> dict:
        """vLLM's answer: the tokenizer as its tokenizer_config.json would describe it (a fast tokenizer from
        tokenizer.json, whatever file the model came from)."""
        tokenizer = self.client.tokenizer

        def token(token_id: int | None) -> str | None:
            return None if token_id is None else tokenizer.backend.id_to_token(token_id)

        eos, bos = tokenizer.eos_token_ids, tokenizer.bos_token_id
        adds_bos = bos is not None and tokenizer.encode("a")[:1] == [bos]  # however the file arranges it
        return {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": token(bos),
                "eos_token": token(eos[0] if eos else None), "pad_token": None, "unk_token": None,
                "add_bos_token": adds_bos, "chat_template": tokenizer.chat_template,
                "model_max_length": self.client.max_model_len, "bos_token_id": tokenizer.bos_token_id,
                "eos_token_ids": list(eos), "vocab_size": self.client.vocab_size}
