"""``flexpage serve MODEL``: serve a zoo model or a local ``save_pretrained`` directory over
OpenAI's API (``/v1/completions``, ``/v1/chat/completions``, ``/v1/models``, ``/health``,
``/metrics``) with uvicorn. Every step shape is compiled before the port opens.

    flexpage serve llama-tiny --port 8000
    flexpage serve path/to/saved/model --max-cached-tokens 65536 --max-batch-size 32
    flexpage serve llama-tiny --speculative ngram --num-speculative-tokens 4
    flexpage serve path/to/saved/model --speculative path/to/small/model   # a draft model, same vocabulary
    torchrun --nproc-per-node 2 -m flexpage.cli serve path/to/saved/model --tp-size 2

Under tensor parallelism every rank builds the engine; rank 0 serves HTTP and the others follow
its steps.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
from typing import TYPE_CHECKING

import torch

from .. import zoo
from ..engine import Engine

if TYPE_CHECKING:
    import uvicorn

    from .runner import EngineRunner


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", type=zoo.model_choice, help="a zoo model name or a local save_pretrained directory")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1, this machine only)")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--served-model-name", help="the name clients pass as `model` (default: MODEL)")
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32")
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--max-cached-tokens", type=int, default=32768, help="KV-cache pool size in tokens")
    parser.add_argument("--kv-cache-dtype", choices=["auto", "int8", "fp8", "float8_e4m3fn"], default="auto",
                        help="the pages' dtype: the model's (auto) or quantised, with a scale per token and KV head")
    parser.add_argument("--max-batch-size", type=int, default=32, help="sequences running at once")
    parser.add_argument("--max-tokens-per-step", type=int, default=512, help="tokens fed per step")
    parser.add_argument("--max-waiting", type=int, default=256,
                        help="requests waiting to be admitted before answering 429 (a call with more prompts: 400)")
    parser.add_argument("--max-request-bytes", type=int,
                        help="largest request body accepted, 413 above it (default: 512 KiB)")
    parser.add_argument("--api-key", default=os.environ.get("FLEXPAGE_API_KEY"),
                        help="require 'Authorization: Bearer KEY' on /v1/* (default: $FLEXPAGE_API_KEY; "
                             "/health and /metrics stay open)")
    parser.add_argument("--allowed-origins", nargs="*", default=[],
                        help="origins allowed to call from a browser (CORS; default: none)")
    parser.add_argument("--shutdown-timeout", type=float, default=30.0,
                        help="seconds SIGTERM waits for running requests before aborting them")
    parser.add_argument("--no-prefix-caching", action="store_true")
    parser.add_argument("--pack-weights", action=argparse.BooleanOptionalAction, default=None,
                        help="keep oneDNN-packed copies of the CPU weights: faster batched decode, 2x weight memory "
                             "(default: when they need at most a quarter of the memory available)")
    parser.add_argument("--compile-decode", action=argparse.BooleanOptionalAction, default=None,
                        help="run decode-only steps as static steps compiled per batch bucket, as Engine(compile_decode) "
                             "and wrap(compile_decode) do (default: where the device policy measured them faster)")
    parser.add_argument("--speculative", metavar="ngram|MODEL",
                        help="speculative decoding: 'ngram' drafts by prompt lookup in each request's own tokens; "
                             "a zoo name or local directory: a draft model with the same vocabulary")
    parser.add_argument("--num-speculative-tokens", type=int, default=4,
                        help="the most drafted tokens a sequence verifies per step (with --speculative)")
    parser.add_argument("--tp-size", type=int, default=1,
                        help="tensor-parallel ranks (run under torchrun; MODEL must be a local directory)")
    args = parser.parse_args(argv)
    load_options = {"dtype": getattr(torch, args.dtype)}
    if args.tp_size > 1:
        from transformers.distributed import DistributedConfig

        if not os.path.isdir(args.model):
            parser.error("--tp-size needs MODEL to be a local save_pretrained directory")
        load_options["distributed_config"] = DistributedConfig(tp_size=args.tp_size)
    try:
        import uvicorn

        from .app import build_app
    except ImportError as error:
        sys.exit(f"flexpage serve needs the serve extra: pip install 'flexpage[serve]' ({error})")
    speculative = args.speculative
    if speculative not in (None, "ngram"):  # a draft model: whole on every rank, not sharded
        try:
            speculative = zoo.load(zoo.model_choice(speculative), dtype=load_options["dtype"])
        except ValueError as error:
            parser.error(f"--speculative: {error}")
    engine = Engine(zoo.load(args.model, **load_options), page_size=args.page_size,
                    max_cached_tokens=args.max_cached_tokens, max_batch_size=args.max_batch_size,
                    max_tokens_per_step=args.max_tokens_per_step, prefix_caching=not args.no_prefix_caching,
                    pack_weights=args.pack_weights, compile_decode=args.compile_decode, speculative=speculative,
                    num_speculative_tokens=args.num_speculative_tokens, kv_dtype=args.kv_cache_dtype)
    if engine.ranks is not None and not engine.ranks.leader:
        engine.follow()  # until rank 0's server stops
        return
    app = build_app(engine, zoo.load_tokenizer(args.model), args.served_model_name or args.model, args.max_waiting,
                    engine_thread=False, max_request_bytes=args.max_request_bytes, api_key=args.api_key,
                    allowed_origins=args.allowed_origins)
    server = uvicorn.Server(uvicorn.Config(app, host=args.host, port=args.port, log_level="info",
                                           timeout_graceful_shutdown=args.shutdown_timeout))
    if not serve(server, app.state.server.runner):
        sys.exit(1)


def serve(server: uvicorn.Server, runner: EngineRunner) -> bool:
    """Run ``server`` (HTTP) on a helper thread and step the engine here, on the main thread that
    built the model and warmed the engine up (see ``runner.py`` on CPU threads); SIGINT / SIGTERM
    stop both gracefully (running requests get the server's graceful-shutdown timeout, then are
    aborted and their pages freed; a second signal forces HTTP's exit). If the engine fails, HTTP
    stops too (every request already answered 503). Returns whether the server started and its
    engine never failed."""

    def handle_exit(*_) -> None:
        server.force_exit = server.should_exit
        server.should_exit = True

    def http() -> None:
        try:
            server.run()
        finally:
            runner.stop()  # also when uvicorn could not start (a port in use)

    previous = {sig: signal.signal(sig, handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        thread = threading.Thread(target=http, name="flexpage-http")
        thread.start()
        runner.run()  # returns when HTTP stops, or when the engine fails
        if runner.failure is not None:  # a supervisor restarts a process that exits non-zero
            server.should_exit = True
        thread.join()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return server.started and runner.failure is None
