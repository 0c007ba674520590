"""The endpoint a user would write in an afternoon, for `checknrun bench endpoint` to compare
with: the latest version restored into the DLRM, one FastAPI route, json.loads, a loop per
feature, the forward, a JSONResponse.

    python -m bench.naive_endpoint file:///tmp/store MODEL PORT
"""

from __future__ import annotations

import json
import sys

import torch
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from publisher.dlrm import SparseBatch, build_model
from publisher.read.module_state import module_state_dict
from publisher.read.restore import restore
from publisher.store import open_store


def app_for(store_url: str, name: str) -> FastAPI:
    with open_store(store_url) as store:
        state = restore(store, name)
    model = build_model(state.manifest.model_config_)
    model.load_state_dict(module_state_dict(model, state))
    model.eval()
    config = model.config
    app = FastAPI()

    @app.post("/predict")
    async def predict(request: Request) -> JSONResponse:
        examples = json.loads(await request.body())["examples"]
        dense = torch.tensor([[ex[d] for d in config.dense] for ex in examples])
        sparse = {}
        for f in config.sparse:
            ids = [ex[f.name] if f.bag else [ex[f.name]] for ex in examples]
            lengths = torch.tensor([len(i) for i in ids])
            offsets = torch.cumsum(lengths, 0) - lengths
            values = torch.tensor([v for i in ids for v in i], dtype=torch.int64)
            sparse[f.name] = SparseBatch(values, offsets)
        with torch.inference_mode():
            scores = torch.sigmoid(model(dense, sparse))
        return JSONResponse({"scores": scores.tolist()})

    return app


def main(argv: list[str]) -> int:
    store_url, name, port = argv
    torch.set_num_threads(1)
    uvicorn.run(app_for(store_url, name), host="127.0.0.1", port=int(port), log_level="warning")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
