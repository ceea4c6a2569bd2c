"""``POST /v1/embeddings`` (OpenAI's shape) on a server with ``model.task:
embed``: each input runs as one pooling request in the engine (its prompt's
prefill; core/sampling_params.py ``POOLING_PARAMS``), which sends back the pooled,
optionally normalized final hidden state with its one finished delta."""
from __future__ import annotations

import asyncio
import base64
import secrets
import time
from typing import Literal

import numpy as np
from fastapi import Request

from fdx.entrypoints.serving.engine_client import EngineDeadError
from fdx.core.messages import EngineRejected, SeqDelta
from fdx.core.sampling_params import POOLING_PARAMS
from fdx.entrypoints.serving.protocol import APIError, Int, TokenId, _Model

MAX_INPUTS = 2048                      # OpenAI's limit on inputs in one request


class EmbeddingRequest(_Model):
    model: str | None = None
    input: str | list[str] | list[TokenId] | list[list[TokenId]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Int | None = None
    user: str | None = None             # accepted, ignored (as in completions)
    add_special_tokens: bool = True     # vLLM's: the tokenizer's BOS/EOS around text inputs


class EmbedGroup:
    """One /v1/embeddings request's pooling requests in the engine."""

    def __init__(self, server, prompts: list[list[int]], rid: str):
        self.server, self.prompts, self.rid = server, prompts, rid
        self.ids = [f"{rid}-{i}" for i in range(len(prompts))]
        self.queue: asyncio.Queue = asyncio.Queue()
        self.vectors: dict[int, np.ndarray] = {}
        self.closed = False

    def start(self) -> None:
        srv = self.server
        srv.groups.add(self)
        srv.metrics.api_in_flight.set(len(srv.groups))
        try:
            for i, (rid, ids) in enumerate(zip(self.ids, self.prompts)):
                srv.engine.add(rid, ids, POOLING_PARAMS, lambda msg, i=i: self.queue.put_nowait((i, msg)))
                srv.metrics.pooling_started(len(ids))
        except Exception:
            self.close()
            raise

    def fail(self, exc: BaseException) -> None:         # the server is stopping
        self.queue.put_nowait((None, exc))

    async def wait(self, http_request: Request) -> list[np.ndarray]:
        while len(self.vectors) < len(self.prompts):
            try:
                i, msg = await asyncio.wait_for(self.queue.get(), timeout=1.0)
            except asyncio.TimeoutError:
                if await http_request.is_disconnected():
                    raise ConnectionAbortedError("the client disconnected") from None
                continue
            if isinstance(msg, BaseException):
                raise msg
            if isinstance(msg, EngineRejected):
                raise APIError(msg.status, msg.message, param="input")
            assert isinstance(msg, SeqDelta)
            if msg.finish_reason is None:
                continue
            if msg.embedding is None:                    # aborted, or the engine does not embed
                raise APIError(503, f"the engine finished input {i} without an embedding "
                               f"({msg.finish_reason})", type="service_unavailable")
            self.vectors[i] = np.frombuffer(msg.embedding, dtype=np.float32)
        return [self.vectors[i] for i in range(len(self.prompts))]

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        srv = self.server
        live = [rid for i, rid in enumerate(self.ids) if i not in self.vectors]
        if live:
            srv.engine.abort(live)
        srv.groups.discard(self)
        srv.metrics.api_in_flight.set(len(srv.groups))


def _prompts(server, req: EmbeddingRequest) -> list[list[int]]:
    inp = req.input
    if isinstance(inp, str):
        inp = [inp]
    if not inp:
        raise APIError(400, "input is empty: give a string, a list of strings or token ids", param="input")
    if len(inp) > MAX_INPUTS:
        raise APIError(400, f"{len(inp)} inputs in one request; the limit is {MAX_INPUTS}", param="input")
    if all(isinstance(x, int) for x in inp):
        inp = [inp]
    prompts = []
    for x in inp:
        ids = server.render._encode(x, "input", add_special_tokens=req.add_special_tokens) \
            if isinstance(x, str) else list(x)
        server.check_prompt(ids, param="input")
        prompts.append(ids)
    return prompts


def install(app, server) -> None:
    @app.post("/v1/embeddings")
    async def embeddings(http_request: Request):
        from fdx.entrypoints.serving.edge import read_request
        req = await read_request(http_request, EmbeddingRequest, server.sc)   # large bodies off the loop
        server.check_model(req.model)
        if server.config.model.task != "embed":
            raise APIError(400, "this server generates (model.task=generate); /v1/embeddings needs a server "
                           "started with --task embed (or model.task: embed)", param="model",
                           code="wrong_task")
        if req.dimensions is not None and req.dimensions != server.hidden_size:
            raise APIError(400, f"dimensions={req.dimensions}: this model's embeddings have {server.hidden_size} "
                           "dimensions and it cannot make others (it is not a Matryoshka model)",
                           param="dimensions")
        server.admit(0)
        prompts = _prompts(server, req)
        server.admit(len(prompts))
        # the response's id is embd-<X-Request-Id, or the one the edge made>, as the other endpoints'
        group = EmbedGroup(server, prompts, f"embd-{http_request.scope.get('fdx.request_id') or secrets.token_hex(12)}")
        group.start()
        try:
            vectors = await group.wait(http_request)
        except (EngineDeadError, ConnectionAbortedError) as e:
            raise APIError(503, str(e), type="service_unavailable") from None
        except APIError:
            raise
        except Exception as e:                           # ServerStopping
            raise APIError(503, str(e), type="service_unavailable") from None
        finally:
            group.close()
        data = [{"object": "embedding", "index": i,
                 "embedding": base64.b64encode(v.astype("<f4").tobytes()).decode("ascii")
                 if req.encoding_format == "base64" else v.tolist()} for i, v in enumerate(vectors)]
        n = sum(len(p) for p in prompts)
        return {"id": group.rid, "object": "list", "created": int(time.time()), "model": server.model_name,
                "data": data, "usage": {"prompt_tokens": n, "total_tokens": n}}
