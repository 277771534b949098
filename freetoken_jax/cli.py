"""The `freetoken-jax` command line: `generate` (one prompt), `chat` (a conversation in the
terminal), `serve` (HTTP and gRPC), `perplexity` (of a text file), `bench` (`python -m
freetoken_jax.bench`), `convert` (`python -m freetoken_jax.convert`) and `ctl` (a running
server's cache)."""

from __future__ import annotations

import argparse
import itertools
import logging
import os
import pathlib
import sys
import time

from freetoken_jax.config import DTYPE_NAMES, SUPPORTED_STRATEGIES
from freetoken_jax.server.tools import FORMATS, detect


def _dtype(name: str) -> str:
    """A dtype flag: convert's short names (bf16, f32) or the long ones."""
    return DTYPE_NAMES.get(name, name)


def _engine_config(args, max_context: int | None = None, max_batch: int = 1):
    from freetoken_jax import EngineConfig

    return EngineConfig(dtype=args.dtype, max_context=max_context or args.max_context, max_batch=max_batch, moe_strategy=args.strategy,
                        total_vram_gb=args.vram_gb, expert_slots_gb=args.slots_gb)  # fmt: skip


def _template_vars(args) -> dict:
    """`chat`'s extra chat-template variables (--template-kwargs, --reasoning-effort), checked as
    the HTTP APIs check theirs."""
    from freetoken_jax.config import ConfigError
    from freetoken_jax.server.chat import template_kwargs, template_vars
    from freetoken_jax.server.service import ApiError

    try:
        return template_vars(args.reasoning_effort, template_kwargs(args.template_kwargs, "--template-kwargs"), param="--template-kwargs")
    except ApiError as e:
        raise ConfigError(e.message) from e


def one_line_errors(fn, debug: bool = False) -> int:
    """Runs `fn()` for a subcommand: a user's error (config, checkpoint, request, missing file)
    is one line on stderr and exit status 2; its traceback only with `debug`."""
    from freetoken_jax.checkpoint.safetensors_io import CheckpointError
    from freetoken_jax.config import ConfigError
    from freetoken_jax.engine import RequestError

    try:
        return fn()
    except (ConfigError, CheckpointError, RequestError, FileNotFoundError) as e:
        if debug:
            raise
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


def printable(text: str) -> str:
    """Text for a terminal: control characters other than newline and tab shown as U+FFFD (a
    random model's bytes would otherwise move the cursor or change colours)."""
    return "".join(c if c.isprintable() or c in "\n\t" else "\ufffd" for c in text)


def _params(args):
    """The request the generation flags make (`GenerationParams`); its `filters` says whether they
    ask for top-k / top-p (the decode step that sorts the vocabulary)."""
    from freetoken_jax.runtime.sampling import GenerationParams

    return GenerationParams(args.max_new_tokens, args.temperature, args.top_k, args.top_p, args.seed)


def _compile(engine, jobs: list, what: str) -> None:
    """Compiles `jobs` (the steps about to run) with a line saying so, so that a first run's
    wait is explained and its decode rate excludes compiling."""
    import jax

    cached = jax.config.jax_compilation_cache_dir
    print(f"compiling {what} (once per shape{'; kept in ' + cached if cached else ''}) ...", end="", file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    engine.runner.steps.precompile(jobs, workers=2)
    print(f" {time.perf_counter() - t0:.1f} s", file=sys.stderr)


def _stream(engine, ids, args, harmony: bool = False) -> tuple[str, float]:
    """Generates after `ids`, printing the text as it completes (`engine.stream_text`); returns
    the text and the seconds to its first piece. `harmony`: the reply is gpt-oss's messages:
    its reasoning goes to stderr (dimmed on a terminal), its answer to stdout and the return."""
    from freetoken_jax.server.harmony import HarmonyStream

    parts, t0, first = [], time.perf_counter(), None
    split = HarmonyStream(calls=False) if harmony else None
    dim = ("\x1b[2m", "\x1b[0m") if sys.stderr.isatty() else ("", "")
    deltas = engine.stream_text(ids, max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                                top_p=args.top_p, seed=args.seed, special=harmony)  # fmt: skip
    for delta in itertools.chain(deltas, [None]):
        events = [("content", delta)] if split is None else split.push(delta) if delta is not None else split.finish()
        for kind, text in (e for e in events if e[1]):
            first = first or time.perf_counter() - t0
            if kind == "reasoning":
                print(dim[0] + printable(text) + dim[1], end="", file=sys.stderr, flush=True)
            else:
                parts.append(text)
                print(printable(text), end="", flush=True)
    print(flush=True)
    return "".join(parts), first or 0.0


def cmd_generate(args) -> int:
    from freetoken_jax import FreeTokenEngine

    engine = FreeTokenEngine.from_pretrained(args.model, _engine_config(args), require_tokenizer=True)
    ids, params = engine.tokenizer.encode(args.prompt), _params(args)
    engine.check_request(ids, params)  # a request the engine would refuse is said before anything compiles or is printed
    _compile(engine, engine.runner.prompt_jobs(len(ids), params.filters), "the prefill and decode steps")
    print(printable(args.prompt), end="", flush=True)
    _, first = _stream(engine, ids, args)
    m = engine.get_metrics()
    print(f"[{m['generated_tokens']} tokens; first text after {first:.2f} s; decode "
          f"{m['decode_tokens_per_second']:.1f} tok/s; prompt {len(ids)} tokens]", file=sys.stderr)  # fmt: skip
    return 0


def cmd_perplexity(args) -> int:
    """The model's perplexity over a text file (`freetoken_jax/perplexity.py`)."""
    import dataclasses
    import json

    from freetoken_jax import FreeTokenEngine
    from freetoken_jax.config import ConfigError
    from freetoken_jax.perplexity import perplexity, window_count
    from freetoken_jax.progress import progress

    text = sys.stdin.read() if args.file == "-" else pathlib.Path(args.file).read_text(encoding="utf-8", errors="replace")
    engine = FreeTokenEngine.from_pretrained(args.model, _engine_config(args, args.ctx + 1, args.batch), require_tokenizer=True)
    ids = engine.tokenizer.encode(text, add_bos=False)
    n = window_count(len(ids), args.ctx, args.max_windows)
    if n < 1:
        raise ConfigError(f"{args.file} has {len(ids)} tokens: fewer than one window of --ctx {args.ctx}")
    print(f"{len(ids)} tokens; scoring {n} windows of {args.ctx} (the first ones compile the steps)", file=sys.stderr)
    t0 = time.perf_counter()
    with progress(n, "scoring", unit="window") as bar:
        r = perplexity(engine, ids, args.ctx, args.max_windows, on_window=lambda: bar.update(1))
    dt = time.perf_counter() - t0
    print(f"perplexity {r.ppl:.4f} ± {r.error:.4f} ({r.tokens} tokens scored, the second halves of {r.windows} windows of {r.ctx}; "
          f"{r.windows * r.ctx / dt:.0f} tok/s)")  # fmt: skip
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps({**dataclasses.asdict(r), "model": args.model, "seconds": dt}, indent=1))
    return 0


def cmd_chat(args) -> int:
    """A conversation in the terminal through the model's chat template; `/reset` starts over,
    `/exit` (or end of input) leaves. Each turn reuses the cached KV of the conversation so far."""
    from freetoken_jax import FreeTokenEngine
    from freetoken_jax.server.text import chat_template, render_chat

    extra = _template_vars(args)  # before loading: a bad flag is said at once
    engine = FreeTokenEngine.from_pretrained(args.model, _engine_config(args), require_tokenizer=True)
    template = getattr(engine.tokenizer, "chat_template", None) or chat_template(engine.model_path)
    system = [{"role": "system", "content": args.system}] if args.system else []
    messages = list(system)
    # the decode step now; each prompt length's prefill compiles on its first turn (every bucket
    # up front would take minutes on a large model)
    harmony = detect(template).name == "harmony"  # gpt-oss: its reasoning is shown apart and not sent back
    _compile(engine, [engine.runner.decode_job(filters=_params(args).filters)], "the decode step")
    print("chat: /reset starts over, /exit leaves", file=sys.stderr)
    while True:
        try:
            line = input("> " if sys.stdin.isatty() else "")
        except EOFError:
            return 0
        if line.strip() in ("/exit", "/quit"):
            return 0
        if line.strip() == "/reset":
            messages = list(system)
            print("(a new conversation)", file=sys.stderr)
            continue
        if not line.strip():
            continue
        messages.append({"role": "user", "content": line})
        ids = engine.tokenizer.encode(render_chat(template, messages, **extra))
        if len(ids) + args.max_new_tokens > engine.engine_config.max_context:
            print(f"(the conversation is {len(ids)} tokens: past --max-context with the reply; /reset)", file=sys.stderr)
            messages.pop()
            continue
        reply, _ = _stream(engine, ids, args, harmony)
        messages.append({"role": "assistant", "content": reply})


def cmd_serve(args) -> int:
    import signal
    import threading

    from freetoken_jax import EngineConfig, FreeTokenEngine
    from freetoken_jax.config import ConfigError
    from freetoken_jax.scheduler.scheduler import Scheduler
    from freetoken_jax.server.grpc_service import serve_grpc
    from freetoken_jax.server.http import bind, serve_http
    from freetoken_jax.server.schemas import Limits
    from freetoken_jax.server.service import Service

    ecfg = EngineConfig(dtype=args.dtype, max_context=args.max_context, max_batch=args.max_batch, moe_strategy=args.strategy,
                        total_vram_gb=args.vram_gb, expert_slots=args.expert_slots, expert_slots_gb=args.slots_gb, hybrid_q=args.hybrid_q,
                        max_running=args.max_running)  # fmt: skip
    try:  # the HTTP port first: a taken one is said now, not after loading and compiling
        sock = bind(args.host, args.port)
    except OSError as e:
        raise ConfigError(f"cannot listen on {args.host}:{args.port}: {e.strerror or e}") from e
    engine = FreeTokenEngine.from_pretrained(args.model, ecfg)
    print(f"model {engine.name}", file=sys.stderr)  # its memory plan is logged by the engine
    sched = Scheduler(engine, max_queue=args.max_queue)
    if not args.no_warm_up:  # the ports open once the steps serving runs are compiled
        sched.warm_up(workers=args.warm_up_workers, scoring=args.warm_up_scoring)
    template = args.chat_template  # a template file, or the template itself
    if template and os.path.isfile(template):
        template = pathlib.Path(template).read_text()
    service = Service(sched, args.served_name or ("demo" if args.model == "demo" else engine.name), engine.model_path, template,
                      tool_parser=args.tool_parser, reasoning_parser=args.reasoning_parser)  # fmt: skip
    api_key = args.api_key or os.environ.get("FREETOKEN_API_KEY") or None
    limits = Limits(max_body_bytes=args.max_body_bytes, request_timeout_s=args.request_timeout)
    httpd = serve_http(service, args.host, args.port, sock=sock, limits=limits, api_key=api_key, admin_key=args.admin_key, log_prompts=args.log_prompts,
                       allowed_origins=[o for o in (args.allowed_origins or "").split(",") if o], max_connections=args.max_connections)  # fmt: skip
    grpc_server, gport = (
        serve_grpc(service, args.host, args.grpc_port, api_key=api_key, limits=limits) if args.grpc_port >= 0 else (None, None)
    )
    print(f"HTTP on http://{args.host}:{httpd.server_address[1]} (OpenAI /v1/chat/completions, Anthropic /v1/messages)", file=sys.stderr)
    if grpc_server is not None:
        print(f"gRPC on {args.host}:{gport}", file=sys.stderr)
    done = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: done.set())
    done.wait()
    print("shutting down: finishing running requests", file=sys.stderr)
    httpd.shutdown()
    if grpc_server is not None:
        grpc_server.stop(5)
    sched.shutdown()
    return 0


class _StderrHandler(logging.StreamHandler):
    """A log handler that writes to whatever `sys.stderr` is when a record comes (a caller
    may have replaced it since the handler was made)."""

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, _):
        pass


def cmd_ctl(args) -> int:
    """Talks to a running server over HTTP."""
    import json
    import urllib.error
    import urllib.request

    if args.what == "status":
        req = urllib.request.Request(args.url + "/v1/cache/status")
    else:
        body = {k: v for k, v in (("expert_slots", args.slots), ("kv_pages", args.kv_pages)) if v is not None}
        body["drain"] = args.drain
        req = urllib.request.Request(
            args.url + "/v1/cache/rebuild", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
        )
    try:
        with urllib.request.urlopen(req, timeout=args.timeout) as r:
            print(json.dumps(json.load(r), indent=1))
        return 0
    except urllib.error.HTTPError as e:
        print(f"error {e.code}: {json.load(e).get('error', {}).get('message', '')}", file=sys.stderr)
        return 2
    except urllib.error.URLError as e:
        print(f"error: cannot reach {args.url}: {e.reason}", file=sys.stderr)
        return 2


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Each option's default in --help, once: not where its help already says its default, nor
    for the defaults that say nothing (None, a switch's False)."""

    def _get_help_string(self, action):
        text = action.help or ""
        if "default" in text or action.default is None or action.default is False or action.default == argparse.SUPPRESS:
            return text
        return super()._get_help_string(action)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="freetoken-jax", description="MoE serving beyond GPU memory, on JAX/XLA.")
    sub = p.add_subparsers(dest="command", required=True)
    compiled = argparse.ArgumentParser(add_help=False)
    cc = compiled.add_mutually_exclusive_group()
    cc.add_argument("--compile-cache", metavar="DIR", default=None,
                    help="keep compiled steps here for the next run (default: <cache dir>/freetoken_jax/xla)")  # fmt: skip
    cc.add_argument("--no-compile-cache", action="store_true", help="compile everything afresh and keep nothing")
    debug = argparse.ArgumentParser(add_help=False)
    debug.add_argument("--debug", action="store_true", help="show the traceback of an error (default: one line)")
    memory = argparse.ArgumentParser(add_help=False)
    memory.add_argument("--vram-gb", type=float, default=None,
                        help="device memory the engine may use, GiB (default: the device's); offload/hybrid plan expert slots from it")  # fmt: skip
    memory.add_argument("--slots-gb", type=float, default=None,
                        help="device memory for expert slots, GB = 1e9 bytes (offload/hybrid; as `bench --slots-gb`; default: what --vram-gb leaves)")  # fmt: skip
    fmt = HelpFormatter
    for name, fn, helptext in (("generate", cmd_generate, "generate text from a prompt"), ("chat", cmd_chat, "chat in the terminal")):
        g = sub.add_parser(name, help=helptext, parents=[compiled, memory, debug], formatter_class=fmt)
        g.add_argument("--model", required=True, help="checkpoint directory, GGUF file, or 'demo'")
        if name == "generate":
            g.add_argument("--prompt", required=True, help="the text to continue")
        else:
            g.add_argument("--system", default=None, help="a system message")
            g.add_argument("--template-kwargs", default=None, metavar="JSON",
                           help='more chat-template variables, a JSON object: \'{"enable_thinking": false}\' turns Qwen3\'s thinking off')  # fmt: skip
            g.add_argument("--reasoning-effort", default=None, choices=["low", "medium", "high"],
                           help="the template's reasoning_effort (gpt-oss's template reads it)")  # fmt: skip
        g.add_argument("--max-new-tokens", "--max-tokens", "-n", type=int, default=48 if name == "generate" else 256, dest="max_new_tokens",
                       help="tokens to generate (per turn)")  # fmt: skip
        g.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
        g.add_argument("--top-k", type=int, default=0, help="0: off")
        g.add_argument("--top-p", type=float, default=1.0, help="1: off")
        g.add_argument("--seed", type=int, default=0, help="sampling seed")
        g.add_argument(
            "--dtype",
            default="bfloat16",
            type=_dtype,
            choices=["bfloat16", "float32"],
            help="activations and dense weights (bf16, f32 also)",
        )
        g.add_argument("--max-context", type=int, default=4096, help="prompt + generated tokens")
        g.add_argument("--strategy", default="fused", choices=SUPPORTED_STRATEGIES, help="where the experts run")
        g.set_defaults(fn=fn)
    pp = sub.add_parser("perplexity", help="a model's perplexity over a text file (as llama-perplexity)", parents=[compiled, memory, debug],
                        formatter_class=fmt)  # fmt: skip
    pp.add_argument("--model", required=True, help="checkpoint directory, GGUF file, or 'demo'")
    pp.add_argument("--file", required=True, help="a UTF-8 text file ('-': standard input)")
    pp.add_argument("--ctx", type=int, default=512, help="tokens a window (llama-perplexity's -c); each scores its second half")
    pp.add_argument("--max-windows", type=int, default=None, help="score at most this many windows (default: the whole text)")
    pp.add_argument("--batch", type=int, default=4, help="windows prefilled at once")
    pp.add_argument("--dtype", default="bfloat16", type=_dtype, choices=["bfloat16", "float32"], help="bf16, f32 also")
    pp.add_argument("--strategy", default="fused", choices=SUPPORTED_STRATEGIES, help="where the experts run")
    pp.add_argument("--json", default=None, help="also write the result here")
    pp.set_defaults(fn=cmd_perplexity)
    for name, helptext in (("bench", "benchmarks (python -m freetoken_jax.bench; `freetoken-jax bench --help` lists them)"),
                           ("convert", "convert a checkpoint to FTW (python -m freetoken_jax.convert)")):  # fmt: skip
        sub.add_parser(name, help=helptext, add_help=False)  # listed here; `main` hands their arguments over
    v = sub.add_parser("serve", help="serve the OpenAI/Anthropic HTTP API and gRPC", parents=[compiled, memory, debug], formatter_class=fmt)
    v.add_argument("--model", required=True, help="checkpoint directory, or 'demo'")
    v.add_argument("--served-model-name", "--served-name", dest="served_name", default=None,
                   help="the model id clients send (default: the directory name)")  # fmt: skip
    v.add_argument("--host", default="127.0.0.1", help="address to listen on")
    v.add_argument("--port", type=int, default=8000, help="HTTP port")
    v.add_argument("--api-key", default=None, help="key every route but /health asks for (default: $FREETOKEN_API_KEY; none: open)")
    v.add_argument("--admin-key", default=None, help="key of /v1/cache/* (default: --api-key; neither: loopback clients only)")
    v.add_argument("--allowed-origins", default=None, help="comma-separated browser origins allowed (CORS); others are refused")
    v.add_argument("--chat-template", default=None, help="a Jinja chat template (a file, or the template itself) over the model's")
    v.add_argument("--tool-parser", default=None, choices=sorted(FORMATS),
                   help="the format tool calls are read in (default: the one the chat template writes; hermes if it shows none)")  # fmt: skip
    v.add_argument("--reasoning-parser", action="store_true",
                   help="put <think>...</think> reasoning in reasoning_content / thinking blocks instead of the content (default: off, as vLLM)")  # fmt: skip
    v.add_argument("--max-body-bytes", type=int, default=8 << 20, help="largest request body")
    v.add_argument("--max-connections", type=int, default=512, help="open connections before new ones get 503")
    v.add_argument("--request-timeout", type=float, default=600.0, help="seconds a non-streaming request may take")
    v.add_argument("--log-prompts", action="store_true", help="log request bodies (prompts) beside the per-request line")
    v.add_argument("--grpc-port", type=int, default=50051, help="-1: no gRPC")
    v.add_argument("--strategy", default="fused", choices=SUPPORTED_STRATEGIES, help="where the experts run")
    v.add_argument("--hybrid-q", type=float, default=0.35, help="hybrid: share of missed experts fetched over PCIe (q* = Bp / (Bp + Bh))")
    v.add_argument("--expert-slots", type=int, default=None, help="expert slots by count (instead of --slots-gb)")
    v.add_argument("--max-num-seqs", "--max-batch", dest="max_batch", type=int, default=4, help="requests decoded together")
    v.add_argument(
        "--max-running",
        type=int,
        default=None,
        help="requests run at once (default: --max-batch; under offload/hybrid no more than one step's experts fit the slots)",
    )
    v.add_argument("--no-warm-up", action="store_true", help="compile steps when first needed instead of before serving")
    v.add_argument("--warm-up-workers", type=int, default=4, help="threads compiling the steps before serving")
    v.add_argument("--warm-up-scoring", action="store_true",
                   help="also compile the prefill steps that score prompts (echo with logprobs: lm-evaluation-harness) before serving")  # fmt: skip
    v.add_argument("--max-queue", type=int, default=64, help="waiting requests before new ones are refused")
    v.add_argument("--max-model-len", "--max-context", dest="max_context", type=int, default=4096, help="prompt + generated tokens")
    v.add_argument("--dtype", default="bfloat16", type=_dtype, choices=["bfloat16", "float32"], help="bf16, f32 also")
    v.set_defaults(fn=cmd_serve)
    c = sub.add_parser("ctl", help="control a running server", parents=[debug], formatter_class=fmt)
    c.add_argument("what", choices=["cache", "status"], help="cache: resize expert slots / KV pages; status: show them")
    c.add_argument("--url", default="http://127.0.0.1:8000", help="the server")
    c.add_argument("--slots", type=int, default=None, help="cache: expert slots wanted")
    c.add_argument("--kv-pages", type=int, default=None, help="cache: KV pages wanted")
    c.add_argument("--drain", action="store_true", help="let running requests finish first instead of failing with 'busy'")
    c.add_argument("--timeout", type=float, default=600, help="seconds to wait for the answer")
    c.set_defaults(fn=cmd_ctl)
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] in ("bench", "convert"):  # their own command lines, --help included
        from freetoken_jax.bench.__main__ import main as bench_main
        from freetoken_jax.checkpoint.convert import main as convert_main

        return (bench_main if argv[0] == "bench" else convert_main)(argv[1:])
    args = build_parser().parse_args(argv)

    log = logging.getLogger("freetoken_jax")  # the engine's choices (strategy, memory plan, limits) on stderr
    if not log.handlers:
        handler = _StderrHandler()
        handler.setFormatter(logging.Formatter("%(message)s"))
        log.addHandler(handler)
        log.setLevel(logging.INFO)
    if hasattr(args, "no_compile_cache") and not args.no_compile_cache:
        from freetoken_jax import compile_cache

        try:
            log.info("compiled steps cached in %s", compile_cache.enable(args.compile_cache))
        except OSError as e:
            print(f"warning: no compile cache ({e}); every step compiles afresh", file=sys.stderr)
    return one_line_errors(lambda: args.fn(args), args.debug)


if __name__ == "__main__":
    sys.exit(main())
