"""Runs parts of vLLM 0.31.0's own code on CPU, in a child process with `.vllm/` first on PYTHONPATH.

Reads one JSON request on stdin, prints one JSON answer on stdout; tests/test_vllm_cpu.py drives it, with both
keys in one request so vLLM is imported once (a child's imports cost about as much as all its checks):
- {"parse": [argv, ...]}: each `vllm serve ...` argv through vLLM's server parser (`make_arg_parser`, then
  `validate_parsed_serve_args`, as `vllm serve` does); per argv the parsed values or the parser's error; and
  `vllm.entrypoints.openai.api_server` imported, with the mcp version it ran with.
- {"lora": {"model": dir, "adapters": [[dir, max_lora_rank], ...]}}, answered under "lora": vLLM's
  Lfm2ForCausalLM built on CPU from the model's config and wrapped by vLLM's WorkerLoRAManager; each adapter
  loaded and added as the worker does it: the vLLM modules it maps, or vLLM's error.
- {"tool_calls": {"model": dir, "tools": [...], "outputs": [text, ...]}}: vLLM's `lfm2` tool parser (the one
  `--tool-call-parser lfm2` registers) over each model output, with a chat request carrying `tools` as OpenCode
  sends them: the request as the parser adjusts it (`skip_special_tokens`) and per output what the server would
  return (tool calls, content).
The platform is forced to vLLM's CpuPlatform (no GPU here); nothing else is replaced.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import sys
from typing import Any

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")


def cpu_platform() -> None:
    import vllm.platforms
    import vllm.platforms.cpu

    vllm.platforms._current_platform = vllm.platforms.cpu.CpuPlatform()


def parse(argv: list[str]) -> dict[str, Any]:
    from vllm.entrypoints.launchers.cli_args import make_arg_parser, validate_parsed_serve_args
    from vllm.tool_parsers import ToolParserManager
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    assert argv[1] == "serve", argv
    parser = make_arg_parser(FlexibleArgumentParser(prog="vllm serve"))
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            args = parser.parse_args(argv[2:])
            args.subparser = "serve"
            validate_parsed_serve_args(args)
    except SystemExit as exc:
        return {"error": f"exit {exc.code}: {err.getvalue().strip().splitlines()[-1:]}"}
    except (TypeError, ValueError) as exc:
        return {"error": f"{type(exc).__name__}: {exc}"}
    values = {k: v for k, v in vars(args).items() if isinstance(v, (str, int, float, bool, type(None), list))}
    values["lora_modules"] = [[m.name, m.path] for m in args.lora_modules or []]
    wtc = args.weight_transfer_config
    values["weight_transfer_backend"] = getattr(wtc, "backend", None)
    if args.tool_call_parser:
        values["tool_parser_class"] = ToolParserManager.get_tool_parser(args.tool_call_parser).__name__
    return {"values": values}


def api_server() -> dict[str, str]:
    """Imports vLLM's OpenAI API server module (what run_job.sh checks after its install step)."""
    import importlib
    from importlib import metadata

    importlib.import_module("vllm.entrypoints.openai.api_server")
    return {"mcp": metadata.version("mcp")}


def lora(model: str, adapters: list[tuple[str, int]]) -> dict[str, Any]:
    """vLLM's Lfm2ForCausalLM built on CPU from `model`'s config (one process, gloo), wrapped by vLLM's own
    WorkerLoRAManager; then each adapter through the worker's `_load_adapter` (PEFTHelper, validate_legal
    against --max-lora-rank, LoRAModel.from_local_checkpoint with the model's module names and its
    hf_to_vllm_mapper) and `add_adapter` into the model's LoRA layers: the modules it maps, or vLLM's error."""
    import socket

    import torch
    from vllm.config import LoRAConfig, ModelConfig, VllmConfig, set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.lora.request import LoRARequest
    from vllm.lora.worker_manager import WorkerLoRAManager
    from vllm.model_executor.layers.linear import LinearBase
    from vllm.model_executor.models.lfm2 import Lfm2ForCausalLM

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    answers: list[dict[str, Any]] = []
    rank = {r for _, r in adapters}
    assert len(rank) == 1, "one --max-lora-rank per request"
    config = VllmConfig(model_config=ModelConfig(model=model, dtype="float32", max_model_len=256),
                        lora_config=LoRAConfig(max_lora_rank=rank.pop(), max_loras=1))
    with set_current_vllm_config(config):
        init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                     distributed_init_method=f"tcp://127.0.0.1:{port}")
        initialize_model_parallel(1, 1)
        net = Lfm2ForCausalLM(vllm_config=config, prefix="")
        linear = sorted(name for name, m in net.named_modules() if isinstance(m, LinearBase))
        worker = WorkerLoRAManager(config, torch.device("cpu"), net.embedding_modules)
        worker.create_lora_manager(net, config)
        for n, (path, _) in enumerate(adapters, start=1):
            try:
                loaded = worker._load_adapter(LoRARequest(f"adapter{n}", n, path))
            except ValueError as exc:
                answers.append({"error": str(exc)})
                continue
            manager = worker._adapter_manager
            manager.add_adapter(loaded)
            manager.activate_adapter(n)  # copies each LoRA into its vLLM layer's slot
            answers.append({"rank": loaded.rank, "modules": sorted(loaded.loras)})  # packed by add_adapter
            manager.remove_adapter(n)
    return {"model": {"linear": linear, "packed": net.packed_modules_mapping}, "adapters": answers}


def tool_calls(model: str, tools: list[dict[str, Any]], outputs: list[str]) -> dict[str, Any]:
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.tokenizers import get_tokenizer
    from vllm.tool_parsers import ToolParserManager

    request = ChatCompletionRequest(model=model, messages=[{"role": "user", "content": "-"}], tools=tools,
                                    tool_choice="auto")
    parser = ToolParserManager.get_tool_parser("lfm2")(get_tokenizer(model), request.tools)
    request = parser.adjust_request(request)
    parsed = []
    for text in outputs:
        info = parser.extract_tool_calls(text, request)
        parsed.append({"tools_called": info.tools_called, "content": info.content,
                       "tool_calls": [call.model_dump() for call in info.tool_calls]})
    return {"skip_special_tokens": request.skip_special_tokens, "parsed": parsed}


def main() -> None:
    request = json.load(sys.stdin)
    with contextlib.redirect_stdout(sys.stderr):  # vLLM logs to stdout; the answer alone goes there
        cpu_platform()
        answer: dict[str, Any] = {}
        if "parse" in request:
            answer.update(parsed=[parse(argv) for argv in request["parse"]], api_server=api_server())
        if "lora" in request:
            answer["lora"] = lora(**request["lora"])
        if "tool_calls" in request:
            answer["tool_calls"] = tool_calls(**request["tool_calls"])
    print(json.dumps(answer, default=str))


if __name__ == "__main__":
    main()
