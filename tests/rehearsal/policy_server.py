"""A vLLM stand-in that plays scripted agents: tests/test_chain.py's right, wrong and missing answers, malformed tool
calls and tool loops, which a tiny model cannot be made to produce on demand. Everything else in the suite samples
from vLLM's own engine (tests/engine). It answers what the capture proxy asks of
`vllm serve ... --return-tokens-as-token-ids --logprobs-mode processed_logprobs`:

    GET  /health, /v1/models (max_model_len)
    POST /v1/chat/completions   prompt_token_ids, choices[0].token_ids, logprobs.content[{token: "token_id:N"}]

Logprobs are real: log_softmax(logits / temperature) of the served model over the full vocabulary (vLLM's
processed logprobs), so OpenEnv's logprobs-mode probe and the trainer's capture measure something.

With a `Script`, the server is the agent's brain: for a task the
script knows it chooses what an agent would say (a tool call that writes the answer, then a final message; or a
wrong answer, no answer, a malformed tool call, a tool loop), renders that reply with the served tokenizer's chat
template exactly as the next request will re-render it, and returns those tokens with the served model's real
processed logprobs for them (one teacher-forced forward pass under the current weights), as vLLM would for tokens
it had sampled. Requests for tasks it does not know (the capture proxy's probes) are sampled as before.
"""

from __future__ import annotations

import copy
import heapq
import itertools
import json
import socket
import threading
import time
import uuid
from collections import OrderedDict
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
import uvicorn
from fastapi import FastAPI
from fastapi.responses import JSONResponse
from torch.overrides import TorchFunctionMode
from transformers import AutoModelForCausalLM, AutoTokenizer

# Sampling fields and the value at which each leaves the distribution untouched; the server samples the
# full vocabulary only, so anything else is refused rather than silently ignored.
NEUTRAL_SAMPLING = {"top_p": 1.0, "min_p": 0.0, "repetition_penalty": 1.0, "presence_penalty": 0.0,
                    "frequency_penalty": 0.0}


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": "invalid_request_error"}}, status_code=status)


def _text(content: Any) -> str:
    """Message content as plain text (OpenAI allows a list of parts)."""
    if isinstance(content, list):
        return "".join(part.get("text", "") for part in content if isinstance(part, dict))
    return "" if content is None else str(content)


class Bf16GemmInFp32(TorchFunctionMode):
    """bf16 linear layers as a GPU runs them: bf16 operands, fp32 accumulation, a bf16 result.

    A CPU without bf16 units emulates the bf16 GEMM about 4x slower than fp32 (70 ms against 18 ms for one
    312-token prefill of the tiny model), and the prefill was most of a rehearsal's CPU. The weights stay bf16.
    """

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func is F.linear and args[0].dtype == torch.bfloat16:
            bias = args[2] if len(args) > 2 else kwargs.get("bias")
            out = F.linear(args[0].float(), args[1].float(), None if bias is None else bias.float())
            return out.to(torch.bfloat16)
        return func(*args, **kwargs)


class OldestTaskFirst:
    """The engine: one generation at a time, the oldest task's requests first, later turns before first ones.

    vLLM batches every request in flight, so on a GPU a group's 8 rollouts finish in about one rollout's time.
    A CPU serves one request at a time: in arrival order, all 32 rollouts in flight (4 groups) crawl forward
    in lockstep and the trainer's first group completes only when nearly all 32 do. Serving the task seen
    first (a group shares its prompt), and within it the request deepest into its conversation, completes
    the groups one after another, in the order the trainer asked for them.
    """

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._waiting: list[tuple[int, int, int]] = []
        self._order = itertools.count()
        self._tasks: dict[str, int] = {}
        self._busy = False

    def acquire(self, task: str, depth: int) -> None:
        """Wait for the engine; `task` is the conversation's first user message, `depth` its message count."""
        with self._cond:
            rank = self._tasks.setdefault(task, len(self._tasks))
            ticket = (rank, -depth, next(self._order))
            heapq.heappush(self._waiting, ticket)
            while self._busy or self._waiting[0] != ticket:
                self._cond.wait()
            heapq.heappop(self._waiting)
            self._busy = True

    def release(self) -> None:
        with self._cond:
            self._busy = False
            self._cond.notify_all()


# What a scripted agent does in a task, turn by turn (Script.reply):
#   right      write(filePath=answer file, content=the right answer), then a final message
#   wrong      the same with a wrong answer
#   none       a final message at once: no answer file
#   malformed  a tool call the parser cannot read (left as text; OpenCode ends on it): no answer file
#   loop       a shell tool call every turn (`sleep LOOP_WAIT_S`), until the agent timeout stops it
MODES = ("right", "wrong", "none", "malformed", "loop")
# The looping agent's shell call waits this long each turn, as an agent polling for data would: a timeout of tens of
# seconds sees a few turns, not dozens (each turn costs OpenCode and the policy double CPU, not the agent's clock).
LOOP_WAIT_S = 5
ANSWER_FILE = "/workdir/answer.txt"
TITLE = "Mean of column x"


class Script:
    """Per-task agent modes: the k-th rollout of a task plays `modes[task][k % len]`, so a group has contrast."""

    def __init__(self, modes: dict[str, list[str]], right: str, wrong: str) -> None:
        unknown = {m for ms in modes.values() for m in ms} - set(MODES)
        if unknown:
            raise ValueError(f"unknown agent modes {sorted(unknown)}; known: {MODES}")
        self.modes, self.right, self.wrong = modes, right, wrong
        self._started: dict[str, int] = {}
        self._lock = threading.Lock()
        self.played: list[tuple[str, str]] = []  # (task, mode) of every rollout started, in order

    def task_of(self, messages: list[dict[str, Any]]) -> str | None:
        user = "\n".join(_text(m.get("content")) for m in messages if m.get("role") == "user")
        return next((task for task in self.modes if task in user), None)

    def reply(self, messages: list[dict[str, Any]], tools: list[Any] | None) -> dict[str, Any] | None:
        """The assistant message to send (OpenAI shape, arguments as JSON text), or None for an unscripted request."""
        task = self.task_of(messages)
        if task is None:
            return None
        if not tools:  # OpenCode's title call (auxiliary): a short title
            return {"role": "assistant", "content": TITLE}
        calls = [c for m in messages if m.get("role") == "assistant" for c in m.get("tool_calls") or []]
        if not calls:
            with self._lock:
                k = self._started.get(task, 0)
                self._started[task] = k + 1
                mode = self.modes[task][k % len(self.modes[task])]
                self.played.append((task, mode))
            return self._first(mode)
        if calls[-1]["function"]["name"] == "bash":
            return _call("bash", {"command": f"sleep {LOOP_WAIT_S}", "description": "Wait for the data"})
        return {"role": "assistant", "content": f"The answer is in {ANSWER_FILE}."}

    def _first(self, mode: str) -> dict[str, Any]:
        if mode in ("right", "wrong"):
            return _call("write", {"filePath": ANSWER_FILE, "content": self.right if mode == "right" else self.wrong})
        if mode == "none":
            return {"role": "assistant", "content": "I could not find the answer."}
        if mode == "malformed":
            return {"role": "assistant", "content": f"<|tool_call_start|>[write(filePath='{ANSWER_FILE}', content="}
        return _call("bash", {"command": f"sleep {LOOP_WAIT_S}", "description": "Wait for the data"})


def _call(name: str, arguments: dict[str, Any]) -> dict[str, Any]:
    return {"role": "assistant", "content": "", "tool_calls": [{
        "id": f"call_{uuid.uuid4().hex[:12]}", "type": "function",
        "function": {"name": name, "arguments": json.dumps(arguments)}}]}


def _for_template(message: dict[str, Any]) -> dict[str, Any]:
    """A message as vLLM hands it to a chat template: text content, tool-call arguments parsed from JSON."""
    out = {**message, "content": _text(message.get("content"))}
    if message.get("tool_calls"):
        out["tool_calls"] = [{**c, "function": {**c["function"], "arguments": json.loads(c["function"]["arguments"])
                                                if isinstance(c["function"]["arguments"], str)
                                                else c["function"]["arguments"]}} for c in message["tool_calls"]]
    return out


class PolicyServer:
    """One model, served on 127.0.0.1 from a background thread."""

    def __init__(self, model_dir: str | Path, *, served_name: str, dtype: str, max_model_len: int,
                 seed: int = 0, script: Script | None = None) -> None:
        self.served_name = served_name
        self.script = script
        self.max_model_len = max_model_len
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).eval()
        self.eos_ids = {self.tokenizer.eos_token_id, *self._config_eos_ids()}
        self.generator = torch.Generator().manual_seed(seed)
        self.url = ""
        # One generation at a time, like vLLM's single engine loop; it also leaves the trainer a core.
        self._engine = OldestTaskFirst()
        # Scored prefixes (token tuple -> model cache), as vLLM's prefix cache: every OpenCode call repeats its long
        # system prompt and the conversation so far (the weights never change here).
        self._prefixes: OrderedDict[tuple[int, ...], Any] = OrderedDict()
        self._server: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None
        self.app = self._build_app()

    def _config_eos_ids(self) -> list[int]:
        eos = self.model.generation_config.eos_token_id
        return [] if eos is None else [eos] if isinstance(eos, int) else list(eos)

    # -- lifecycle ------------------------------------------------------------
    def start(self, host: str = "127.0.0.1") -> str:
        """Serve on a free loopback port; return the base URL once the server accepts connections."""
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.bind((host, 0))
        self._server = uvicorn.Server(uvicorn.Config(self.app, log_level="warning", access_log=False))
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [sock]}, daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 60
        while not self._server.started:
            if time.monotonic() > deadline:
                raise RuntimeError("policy server did not start within 60 s")
            time.sleep(0.05)
        self.url = f"http://{host}:{sock.getsockname()[1]}"
        return self.url

    def stop(self, timeout_s: float = 60.0) -> None:
        """Shut the server down and wait for it: a generation still running in a daemon thread when the
        interpreter exits aborts the whole process ("terminate called without an active exception")."""
        if self._server is not None:
            self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout_s)

    # -- generation -----------------------------------------------------------
    def _sampling_error(self, body: dict[str, Any]) -> str | None:
        if body.get("stream"):
            return "stream=true is not supported by the rehearsal server (the capture proxy never streams upstream)"
        if body.get("n", 1) != 1:
            return "n must be 1"
        for key, neutral in NEUTRAL_SAMPLING.items():
            if body.get(key) is not None and float(body[key]) != neutral:
                return f"{key}={body[key]} truncates the distribution; this server samples the full vocabulary only"
        if body.get("top_k") not in (None, 0, -1):
            return f"top_k={body['top_k']} truncates the distribution; use -1"
        return None

    @torch.inference_mode()  # no autograd bookkeeping at all: one-token decode steps are mostly overhead
    def _generate(self, prompt_ids: list[int], max_new: int, temperature: float,
                  top_logprobs: int) -> tuple[list[int], list[dict[str, Any]], str]:
        """Sample up to `max_new` tokens; return ids, processed logprob entries and the finish reason."""
        with Bf16GemmInFp32():  # the prefill only: one-token decode steps are cheap in bf16
            out = self.model(input_ids=torch.tensor([prompt_ids]), use_cache=True)
        ids: list[int] = []
        entries: list[dict[str, Any]] = []
        while len(ids) < max_new:
            logits = out.logits[0, -1].float()
            logprobs = torch.log_softmax(logits / temperature if temperature > 0 else logits, dim=-1)
            if temperature > 0:
                token = int(torch.multinomial(logprobs.exp(), 1, generator=self.generator))
            else:
                token = int(logits.argmax())
            ids.append(token)
            entry: dict[str, Any] = {"token": f"token_id:{token}", "logprob": float(logprobs[token]), "bytes": None}
            if top_logprobs:
                values, indices = logprobs.topk(top_logprobs)
                entry["top_logprobs"] = [{"token": f"token_id:{int(i)}", "logprob": float(v), "bytes": None}
                                         for v, i in zip(values, indices, strict=True)]
            entries.append(entry)
            if token in self.eos_ids:
                return ids, entries, "stop"
            out = self.model(input_ids=torch.tensor([[token]]), past_key_values=out.past_key_values, use_cache=True)
        return ids, entries, "length"

    PREFIXES = 48  # cached prefixes kept (a few MB each for the tiny model)

    @torch.inference_mode()
    def _score(self, prompt_ids: list[int], ids: list[int], temperature: float) -> list[dict[str, Any]]:
        """Processed logprobs of `ids` after `prompt_ids` under the served weights: a teacher-forced pass that
        resumes from the longest cached prefix and caches the system block, the prompt and the whole sequence."""
        seq = prompt_ids + ids
        start = max((k for k in self._prefixes if len(k) <= len(prompt_ids) and tuple(seq[:len(k)]) == k),
                    key=len, default=())
        system_end = next((i + 1 for i, t in enumerate(prompt_ids) if t in self.eos_ids), 0)
        cuts = sorted({c for c in (system_end, len(prompt_ids), len(seq)) if c > len(start)})
        cache, last = copy.deepcopy(self._prefixes[start]) if start else (None, None)
        logits, done = [] if last is None else [last[None]], len(start)
        with Bf16GemmInFp32():
            for cut in cuts:
                out = self.model(input_ids=torch.tensor([seq[done:cut]]), past_key_values=cache, use_cache=True)
                cache, done = out.past_key_values, cut
                logits.append(out.logits[0].float())
                self._prefixes[tuple(seq[:cut])] = (copy.deepcopy(cache), logits[-1][-1].clone())
        while len(self._prefixes) > self.PREFIXES:
            self._prefixes.popitem(last=False)
        # Row r holds the logits after token len(start) - 1 + r (a cached prefix keeps its last row): the
        # completion's tokens are predicted from the last prompt position on.
        offset = len(start) - (0 if last is None else 1)
        logits = torch.cat(logits)[len(prompt_ids) - 1 - offset:len(seq) - 1 - offset]
        logprobs = torch.log_softmax(logits / temperature if temperature > 0 else logits, dim=-1)
        return [{"token": f"token_id:{t}", "logprob": float(logprobs[i, t]), "bytes": None} for i, t in enumerate(ids)]

    def _scripted(self, messages: list[dict[str, Any]], tools: list[Any] | None,
                  reply: dict[str, Any]) -> tuple[list[int], list[int], str]:
        """Prompt ids, the reply's completion ids (what the template renders for it, through its end-of-turn token)
        and the finish reason: the next turn's prompt then starts with prompt + completion, as with vLLM."""
        convo = [_for_template(m) for m in messages]
        prompt_ids = list(self.tokenizer.apply_chat_template(
            convo, tools=tools or None, add_generation_prompt=True, tokenize=True, return_dict=False))
        full = list(self.tokenizer.apply_chat_template(
            [*convo, _for_template(reply)], tools=tools or None, tokenize=True, return_dict=False))
        if full[:len(prompt_ids)] != prompt_ids:
            raise RuntimeError("the chat template does not render the reply as a continuation of its prompt")
        rest = full[len(prompt_ids):]
        end = next(i for i, t in enumerate(rest) if t in self.eos_ids)
        return prompt_ids, rest[:end + 1], "tool_calls" if reply.get("tool_calls") else "stop"

    def complete(self, body: dict[str, Any]) -> JSONResponse:
        """One chat completion in vLLM's shape (with return_token_ids and processed logprobs)."""
        if body.get("model") not in (None, self.served_name):
            return _error(404, f"The model `{body.get('model')}` does not exist (serving {self.served_name!r}).")
        problem = self._sampling_error(body)
        if problem:
            return _error(400, problem)
        messages = [{**m, "content": _text(m.get("content"))} for m in body.get("messages") or []]
        reply = self.script.reply(messages, body.get("tools")) if self.script else None
        if reply is not None:
            prompt_ids, scripted, finish = self._scripted(messages, body.get("tools"), reply)
        else:
            prompt_ids = list(self.tokenizer.apply_chat_template(
                messages, tools=body.get("tools") or None, add_generation_prompt=True, tokenize=True,
                return_dict=False))
        room = self.max_model_len - len(prompt_ids)
        requested = body.get("max_completion_tokens") or body.get("max_tokens") or room
        if room <= 0 or requested > room:
            return _error(400, f"This model's maximum context length is {self.max_model_len} tokens; the prompt "
                               f"has {len(prompt_ids)} tokens and {requested} were requested.")
        temperature = 1.0 if body.get("temperature") is None else float(body["temperature"])
        task = next((m["content"] for m in messages if m.get("role") == "user"), "")
        self._engine.acquire(task, depth=len(messages))
        try:
            if reply is not None:
                ids = scripted[:int(requested)]
                finish = finish if len(ids) == len(scripted) else "length"
                entries = self._score(prompt_ids, ids, temperature)
            else:
                ids, entries, finish = self._generate(prompt_ids, int(requested), temperature,
                                                      int(body.get("top_logprobs") or 0))
        finally:
            self._engine.release()
        message = {"role": "assistant", "content": self.tokenizer.decode(ids, skip_special_tokens=True)}
        if reply is not None and finish != "length":  # what vLLM's tool parser makes of the rendered call
            message = {"role": "assistant", "content": reply.get("content") or None,
                       **({"tool_calls": reply["tool_calls"]} if reply.get("tool_calls") else {})}
        choice: dict[str, Any] = {
            "index": 0,
            "message": message,
            "finish_reason": finish,
            "token_ids": ids if body.get("return_token_ids") else None,
            "logprobs": {"content": entries} if body.get("logprobs") else None,
        }
        return JSONResponse({
            "id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()),
            "model": self.served_name, "choices": [choice],
            "prompt_token_ids": prompt_ids if body.get("return_token_ids") else None,
            "usage": {"prompt_tokens": len(prompt_ids), "completion_tokens": len(ids),
                      "total_tokens": len(prompt_ids) + len(ids)},
        })

    # -- routes ---------------------------------------------------------------
    def _build_app(self) -> FastAPI:
        app = FastAPI(title="rehearsal-policy-server")

        @app.get("/health")
        def health() -> dict[str, str]:
            return {"status": "ok"}

        @app.get("/v1/models")
        def models() -> dict[str, Any]:
            return {"object": "list", "data": [{"id": self.served_name, "object": "model", "owned_by": "rehearsal",
                                                "max_model_len": self.max_model_len}]}

        @app.post("/v1/chat/completions")
        def chat(body: dict[str, Any]) -> JSONResponse:
            return self.complete(body)

        return app
