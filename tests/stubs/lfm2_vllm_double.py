"""vLLM's engine stand-in for LFM2.5 with a scripted policy, running vLLM 0.31.0's own request and reply code.

vLLM cannot run on a CPU test machine, and a random tiny model never writes a tool call. This server answers
`POST /v1/chat/completions` the way `serve_policy.sh`'s vLLM does, with everything but the sampling done by
the real code, so that what OpenCode sees and sends back is what it would see and send back in a job:

- the prompt: vLLM's `_postprocess_messages` (tool-call `arguments` JSON strings become dicts), then the
  served tokenizer's chat template (the one `--chat-template` names, else the model folder's), rendered to
  text and encoded without added special tokens, as vLLM's HF renderer does;
- the completion: a scripted text per turn (what a trained LFM2.5 writes), encoded, plus the eos token;
  its logprobs come from the tiny model (the scored window is capped, see `LOGPROB_WINDOW`);
- the reply: decoded with special tokens kept (vLLM's `Lfm2ToolParser.adjust_request` forces that when tools
  are sent) and split by vLLM's own `Lfm2ToolParser.extract_tool_calls` into `content` and `tool_calls`, with
  vLLM's tool-call ids and finish reason, plus `prompt_token_ids`, `choices[0].token_ids` and
  `logprobs.content[{token: "token_id:N"}]` (`--return-tokens-as-token-ids`).

It takes `vllm serve`'s argv (the model folder, --served-model-name, --host, --port, --chat-template,
--max-model-len; every other flag is accepted and ignored), so `serve_policy.sh` can start it as its `VLLM`
(tests/stubs/vllm_lfm2 puts `.vllm/`, where setup.sh installs vLLM's Python code, first on PYTHONPATH):

    LFM2_DOUBLE_SCRIPT=script.json VLLM=tests/stubs/vllm_lfm2 MODEL=DIR bash serve_policy.sh

`script.json` (read again for every request, so a caller may change it between conversations) is a list of
completion texts: request k of a conversation (k = the number of assistant
messages it already holds) gets entry k, the last entry repeating. When the rendered prompt ends inside an
opened `<think>`, the scripted model closes it first (`</think>`: it thinks nothing). A request without tools
(OpenCode's title call) gets `TITLE`. With LFM2_DOUBLE_LOG set, every request and reply is appended to it as one
JSON line.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import time
import uuid
from pathlib import Path
from typing import Any

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

import torch  # noqa: E402
import uvicorn  # noqa: E402
from fastapi import FastAPI  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402
from vllm.entrypoints.chat_utils import _postprocess_messages, make_tool_call_id  # noqa: E402
from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest  # noqa: E402
from vllm.tool_parsers.lfm2_tool_parser import Lfm2ToolParser  # noqa: E402

TITLE = "Count rows"
# Prompt tokens the tiny model scores the completion with: OpenCode's system prompt and tool list are ~40k
# byte tokens, past what a CPU attends to in a test; the values only have to be real logprobs of real tokens.
LOGPROB_WINDOW = 512


def text_of(content: Any) -> str:
    """vLLM's "string" content format: text parts joined with newlines, no content as ""."""
    if content is None:
        return ""
    if isinstance(content, list):
        return "\n".join(part.get("text", "") for part in content if isinstance(part, dict))
    return str(content)


class Engine:
    """The tokenizer and template vLLM would serve with, the tiny model for logprobs, the scripted policy."""

    def __init__(self, model_dir: str, served_name: str, script: Path, chat_template: str | None,
                 log: str | None) -> None:
        self.served_name = served_name
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        if chat_template is not None:
            self.tokenizer.chat_template = chat_template
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        self.script = script
        self.log = log

    def prompt_ids(self, body: dict[str, Any]) -> list[int]:
        conversation = [{**m, "content": text_of(m.get("content"))} for m in copy.deepcopy(body["messages"])]
        _postprocess_messages(conversation)
        text = self.tokenizer.apply_chat_template(conversation, tools=body.get("tools") or None,
                                                  add_generation_prompt=True, tokenize=False)
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    @torch.inference_mode()
    def logprobs(self, prompt_ids: list[int], ids: list[int], temperature: float) -> list[float]:
        window = prompt_ids[-LOGPROB_WINDOW:]
        logits = self.model(input_ids=torch.tensor([window + ids])).logits[0, len(window) - 1 : -1].float()
        scores = torch.log_softmax(logits / (temperature or 1.0), dim=-1)
        return [float(scores[i, token]) for i, token in enumerate(ids)]

    def complete(self, body: dict[str, Any]) -> dict[str, Any]:
        prompt_ids = self.prompt_ids(body)
        if body.get("tools"):
            turn = sum(1 for m in body["messages"] if m.get("role") == "assistant")
            script = json.loads(self.script.read_text())
            text = script[min(turn, len(script) - 1)]
        else:
            text = TITLE
        if self.tokenizer.decode(prompt_ids[-8:]).endswith("<think>"):
            text = "</think>" + text
        ids = list(self.tokenizer.encode(text, add_special_tokens=False)) + [self.tokenizer.eos_token_id]
        logprobs = self.logprobs(prompt_ids, ids, float(body.get("temperature") or 1.0))
        request = ChatCompletionRequest(**body)
        message: dict[str, Any] = {"role": "assistant", "content": None}
        finish = "stop"
        if request.tools and request.tool_choice in (None, "auto"):
            parser = Lfm2ToolParser(self.tokenizer, request.tools)
            request = parser.adjust_request(request)
            output = self.tokenizer.decode(ids[:-1], skip_special_tokens=request.skip_special_tokens)
            info = parser.extract_tool_calls(output, request)
            message["content"] = info.content
            if info.tools_called:
                message["tool_calls"] = [{"id": tc.id or make_tool_call_id(), "type": "function",
                                          "function": {"name": tc.function.name,
                                                       "arguments": tc.function.arguments}}
                                         for tc in info.tool_calls]
                finish = "tool_calls"
        else:
            message["content"] = self.tokenizer.decode(ids[:-1], skip_special_tokens=True)
        reply = {
            "id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()),
            "model": self.served_name, "prompt_token_ids": prompt_ids,
            "choices": [{"index": 0, "message": message, "finish_reason": finish, "token_ids": ids,
                         "logprobs": {"content": [{"token": f"token_id:{t}", "logprob": lp, "bytes": None,
                                                   "top_logprobs": []} for t, lp in zip(ids, logprobs, strict=True)]}}],
            "usage": {"prompt_tokens": len(prompt_ids), "completion_tokens": len(ids),
                      "total_tokens": len(prompt_ids) + len(ids)},
        }
        if self.log:
            with open(self.log, "a") as fh:
                fh.write(json.dumps({"request": body, "reply": reply}) + "\n")
        return reply


def build_app(engine: Engine, max_model_len: int) -> FastAPI:
    app = FastAPI(title="lfm2-vllm-double")

    @app.get("/health")
    def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/v1/models")
    def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": engine.served_name, "object": "model", "owned_by": "vllm",
                                            "max_model_len": max_model_len}]}

    @app.post("/v1/chat/completions")
    def chat(body: dict[str, Any]) -> dict[str, Any]:
        return engine.complete(body)

    return app


def main() -> None:
    parser = argparse.ArgumentParser(prog="vllm", description=__doc__.splitlines()[0])
    parser.add_argument("command", choices=["serve"])
    parser.add_argument("model")
    parser.add_argument("--served-model-name", required=True)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--chat-template", default=None, help="a template file, as vLLM's --chat-template")
    parser.add_argument("--max-model-len", type=int, required=True)
    args, _ignored = parser.parse_known_args()
    template = Path(args.chat_template).read_text() if args.chat_template else None
    script = Path(os.environ["LFM2_DOUBLE_SCRIPT"])
    engine = Engine(args.model, args.served_model_name, script, template, os.environ.get("LFM2_DOUBLE_LOG"))
    uvicorn.run(build_app(engine, args.max_model_len), host=args.host, port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
