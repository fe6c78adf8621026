"""The pipeline's stages as small timed functions, each calling the real module that does the work.

Every builder takes the shared `Setup` and returns `Stage`s: a name, a group (request,
engine, stream, wire, in the order a request meets them), a zero-argument function that
does the stage once, and how many tokens one call handles (the per-token column; 0 when
the stage is per request). A stage whose `fn` returns an int reports that as its own
duration in ns (for waits that the caller cannot time around: a cross-thread wake-up).
"""

import asyncio
import socket
import threading
import time
from functools import partial
from typing import Callable, NamedTuple, Optional

import h2.config
import h2.connection
import h2.settings
import numpy as np
import orjson

from ..core.detokenizer import Detokenizer
from ..core.doorbell import Doorbell
from ..core.executor import SeqStep
from ..core.options import EngineOptions
from ..core.outputs import RequestOutput, StepTokens, Timeline
from ..core.sampling_params import SamplingParams
from ..kernels.mock import CHAT_TEMPLATE
from ..kernels.sampling import sample
from ..net.api.chat_template import ChatTemplate
from ..net.api.fields import parse_json
from ..net.api.model_info import model_info, prompt_encoder
from ..net.api.openai import parse_chat, parse_completions
from ..net.app import App
from ..net.metrics import Metrics
from ..net.protocol.events import Limits
from ..net.protocol import frames
from ..net.protocol.http2 import HALF_CLOSED_LOCAL, MAX_WINDOW, H2Session
from ..net.writer import encoders
from ..net.writer.dispatch import Dispatcher, Exchange
from ..net.writer.outbox import Outbox
from ..runtime import build_engine

_COMPLETION = parse_completions({"prompt": "x", "stream": True})     # the request the written exchanges answer


class Stage(NamedTuple):
    name: str
    group: str                  # "request" | "engine" | "stream" | "wire"
    fn: Optional[Callable[[], object]]  # one call; an int result is its own duration (ns); None: skipped (note says why)
    num_tokens: int = 0         # tokens one call handles; 0: a per-request stage
    note: str = ""


class Setup(NamedTuple):
    """What the stages share: the loaded engine, its text, and the sizes to time at."""
    engine: object              # engine_build Engine (tokenizer, chat template, tensors)
    executors: dict             # backend name -> Executor over the engine
    prompt_text: str
    prompt_ids: list
    batch_sizes: tuple          # streams per step for the scheduler, sampling and HTTP/2 stages
    engine_batch_sizes: tuple   # sequences per engine decode step
    payload: bytes              # one streamed chunk, as the SSE encoder writes it


# ---------------------------------------------------------------- request

def request_stages(s: Setup) -> list:
    completions = orjson.dumps({"model": "m", "prompt": s.prompt_text, "max_tokens": 128, "temperature": 0.7,
                                "top_p": 0.9, "stream": True, "stream_options": {"include_usage": True}})
    messages = [{"role": "system", "content": "You are a helpful assistant."},
                {"role": "user", "content": s.prompt_text}]
    chat = orjson.dumps({"model": "m", "messages": messages, "max_tokens": 128, "stream": True})
    source = s.engine.chat_template or CHAT_TEMPLATE
    template = ChatTemplate(source, {"bos_token": "<s>", "eos_token": "</s>"})
    note = "" if s.engine.chat_template else "the engine has no chat template: ChatML"
    return [
        Stage("parse + validate /v1/completions", "request", lambda: parse_completions(parse_json(completions)),
              note=f"{len(completions)} B body"),
        Stage("parse + validate /v1/chat/completions", "request", lambda: parse_chat(parse_json(chat)),
              note=f"{len(chat)} B body"),
        Stage("chat template (2 messages)", "request", lambda: template.render(messages), note=note),
        Stage(f"tokenize prompt ({len(s.prompt_ids)} tokens), tokenizers", "request",
              lambda: s.engine.encode_prompt(s.prompt_text), num_tokens=len(s.prompt_ids)),
        server_tokenize_stage(s),
        intake_stage(s),
    ]


INTAKE_BATCH = 100                  # requests per connection in the intake stage (under max_concurrent_streams)


def intake_stage(s: Setup) -> Stage:
    """One streamed /v1/completions request from its HTTP/2 bytes to the engine's inbox, as
    the loop takes it in: the session's frames and headers, `App.on_events` (route, parse,
    tokenize, checks, the engine's Request and the writer's Exchange). The mock engine's
    thread is not started (`is_alive` says it runs), so nothing is stepped: every 100
    requests a fresh connection, the inbox and the exchanges emptied."""
    built = build_engine(EngineOptions(backend="mock", max_queued_requests=1 << 30))
    core = built.core
    core.is_alive = lambda: True        # a running engine thread is all the routes ask of it
    app = App(metrics=Metrics())
    info = model_info(built.card)
    app.attach(core, info, asyncio.new_event_loop())
    body = orjson.dumps({"model": info.name, "prompt": s.prompt_text, "max_tokens": 64, "stream": True})
    headers = [(":method", "POST"), (":scheme", "http"), (":authority", "bench"), (":path", "/v1/completions"),
               ("content-type", "application/json"), ("content-length", str(len(body)))]
    state = {"left": 0}

    def connect():
        client = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
        client.initiate_connection()
        session = H2Session(Limits(max_concurrent_streams=INTAKE_BATCH))
        session.receive_data(client.data_to_send())
        session.data_to_send()
        chunks = []
        for i in range(INTAKE_BATCH):
            client.send_headers(2 * i + 1, headers)
            client.send_data(2 * i + 1, body, end_stream=True)
            chunks.append(client.data_to_send())
        core._inbox.clear()
        core._live_ids.clear()
        app.exchanges.clear()
        state.update(conn=SocketlessConnection(session), chunks=iter(chunks), left=INTAKE_BATCH)

    def take_one():
        if not state["left"]:
            connect()
        state["left"] -= 1
        conn = state["conn"]
        app.on_events(conn, conn.session.receive_data(next(state["chunks"])))

    take_one()
    if len(core._inbox) != 1:
        answer = state["conn"].session.data_to_send()[:300]
        raise RuntimeError(f"the intake stage's request did not reach the engine; the server answered {answer!r}")
    return Stage("intake: HTTP/2 request to the engine's inbox (/v1/completions)", "request", take_one,
                 note=f"{len(body)} B body, the mock engine's tokenizer; frames, route, parse, tokenize, Request, Exchange")


def server_tokenize_stage(s: Setup) -> Stage:
    """The encoder the server uses (net/model_info.prompt_encoder): for byte-level BPE the
    piece cache of net/api/prompt_encoder.py, warm after the first call (a prompt in every 256 is
    also encoded by tokenizers, to check); otherwise the same call as the stage above."""
    encode = prompt_encoder(s.engine)
    fast = encode != s.engine.encode_prompt     # bound methods compare equal, never identical
    encode(s.prompt_text)
    return Stage(f"tokenize prompt ({len(s.prompt_ids)} tokens), server", "request", lambda: encode(s.prompt_text),
                 num_tokens=len(s.prompt_ids),
                 note="piece cache (net/api/prompt_encoder.py)" if fast else "no piece cache for this tokenizer: tokenizers")


# ----------------------------------------------------------------- engine

def scheduler_stages(s: Setup) -> list:
    """EngineCore.step over the mock executor (zero-cost step): scheduler + bookkeeping + detokenizer."""
    out = []
    for batch in s.batch_sizes:
        core = build_engine(EngineOptions(backend="mock", max_model_len=1 << 16, num_kv_blocks=batch * 4200,
                                          max_num_seqs=batch)).core
        prompt = core.tokenizer.encode(s.prompt_text, add_special_tokens=False).ids[:16]
        for i in range(batch):
            core.add_request(i, prompt, SamplingParams(ignore_eos=True), Timeline())
        core.step()                                     # prefill every request: later steps are decode steps
        out.append(Stage(f"scheduler step, mock executor ({batch} running)", "engine", _stepper(core),
                         num_tokens=batch, note="EngineCore.step: schedule, mock step, append, detokenize"))
    return out


def _stepper(core):
    def step():
        outputs = core.step().rows
        if len(outputs) and outputs[0].finish_reason is not None:
            raise RuntimeError("a scheduler-stage request finished: raise max_model_len")
    return step


def engine_stages(s: Setup) -> list:
    out = []
    greedy = SamplingParams(temperature=0.0)
    for backend, executor in s.executors.items():
        bs = executor.block_size
        prompt = s.prompt_ids[: min(len(s.prompt_ids), executor.config.max_position_embeddings - 2)]
        blocks = list(range(-(-(len(prompt) + 1) // bs)))
        prefill = [SeqStep(0, prompt, 0, blocks, True, greedy, 0, prompt, [])]
        out.append(Stage(f"engine prefill [{backend}] ({len(prompt)} tokens)", "engine",
                         lambda e=executor, p=prefill: e.step(p), num_tokens=len(prompt)))
        for batch in s.engine_batch_sizes:
            seqs = _decode_batch(executor, prompt, batch, greedy)
            if seqs is None:
                out.append(Stage(f"engine decode step [{backend}] (batch {batch})", "engine", None,
                                 note=f"skipped: {batch} contexts do not fit the executor's KV cache"))
                continue
            out.append(Stage(f"engine decode step [{backend}] (batch {batch})", "engine",
                             lambda e=executor, q=seqs: e.step(q), num_tokens=batch,
                             note=f"context {len(prompt) + 1}"))
    return out


def _decode_batch(executor, prompt: list, batch: int, params: SamplingParams):
    """`batch` sequences each decoding one token after `prompt` (their own KV blocks), or None if they don't fit."""
    bs = executor.block_size
    per_seq = -(-(len(prompt) + 1) // bs)
    if per_seq * batch > executor.num_blocks:
        return None
    return [SeqStep(i, [prompt[-1]], len(prompt), list(range(i * per_seq, (i + 1) * per_seq)), True, params, i,
                    prompt, [prompt[-1]]) for i in range(batch)]


def sampling_stages(s: Setup) -> list:
    vocab = s.engine.config.vocab_size
    rng = np.random.default_rng(0)
    out = []
    for batch in s.batch_sizes:
        logits = rng.standard_normal((batch, vocab), dtype=np.float32) * 3
        for label, params in (("greedy", SamplingParams(temperature=0.0)),
                              ("T=0.8 top_p=0.9", SamplingParams(temperature=0.8, top_p=0.9))):
            seqs = [SeqStep(i, [1], 10, [0], True, params, i, [1], [1] * 5) for i in range(batch)]
            out.append(Stage(f"sampling {label} (batch {batch})", "engine", lambda lg=logits, q=seqs: sample(lg, q),
                             num_tokens=batch, note=f"vocab {vocab}"))
    return out


# ----------------------------------------------------------------- stream

def detokenize_stages(s: Setup) -> list:
    detok = Detokenizer(s.engine.tokenizer)
    ids = s.prompt_ids or [1]
    state = {"stream": detok.stream(ids[:1], SamplingParams()), "i": 0}

    def push():
        i = state["i"]
        state["i"] = i + 1
        if i % 4096 == 4095:                             # bound the stream's history
            state["stream"] = detok.stream(ids[:1], SamplingParams())
        return state["stream"].push(ids[i % len(ids)]) and None

    return [Stage("detokenize (incremental, per token)", "stream", push, num_tokens=1)]


def encode_stages(s: Setup) -> list:
    out = RequestOutput(7, [1234], " the", None, None, 16, 3, 0)
    text = lambda token_id: " the"  # noqa: E731 (only the logprobs path calls it)
    sse = encoders.CompletionSse("cmpl-7", 1700000000, "model", False, text)
    chat = encoders.ChatSse("chatcmpl-7", 1700000000, "model", False, text)
    ndjson, binary = encoders.Ndjson(), encoders.BinaryTokens()
    return [Stage("encode SSE chunk (completions)", "stream", lambda: sse.token(out), num_tokens=1),
            Stage("encode SSE chunk (chat)", "stream", lambda: chat.token(out), num_tokens=1),
            Stage("encode NDJSON line", "stream", lambda: ndjson.token(out), num_tokens=1),
            Stage("encode binary token", "stream", lambda: binary.token(out), num_tokens=1)]


# ------------------------------------------------------------------- wire

def session_stages(s: Setup) -> list:
    out = []
    for batch in s.batch_sizes:
        session, stream_ids = _open_h2_session(batch)
        payload = s.payload

        def write_step(session=session, stream_ids=stream_ids):
            for sid in stream_ids:
                session.send_data(sid, payload)
            return len(session.data_to_send()) and None

        out.append(Stage(f"HTTP/2 DATA frames via H2Session ({batch} streams)", "wire", write_step,
                         num_tokens=batch, note=f"{len(payload)} B chunks, one data_to_send per step"))
    return out


def framing_stages(s: Setup) -> list:
    """A step's SSE token chunks for one connection as DATA frames (net/protocol/frames.py):
    the C `frame_data` against its Python twin, on the same items."""
    prefix, suffix = encoders.CompletionSse("cmpl-7", 1700000000, "model", False, str).text_parts()
    impls = [("C", frames.frame_data)] if frames.NATIVE else []
    impls.append(("Python", frames.frame_data_py))
    stages = []
    for batch in s.batch_sizes:
        session, stream_ids = _open_h2_session(batch)
        items = [(session.data_key(sid), prefix, " the", suffix) for sid in stream_ids]
        for name, frame_data in impls:
            def frame_step(session=session, items=items, frame_data=frame_data):
                frame_data(session, iter(items), [], HALF_CLOSED_LOCAL)
                _open_windows(session)
            stages.append(Stage(f"SSE chunks to DATA frames, {name} ({batch} streams)", "wire", frame_step,
                                num_tokens=batch, note="splice and frame into one bytes object; no socket"))
    return stages


def _open_windows(session: H2Session) -> None:
    """A bench writes gigabytes: the send windows are opened again whenever they run low."""
    if session.send_window < MAX_WINDOW // 2:
        session.send_window = MAX_WINDOW
        for st in session.streams.values():
            st.send_window = MAX_WINDOW


def _open_h2_session(num_streams: int):
    """A server H2Session with `num_streams` requests open and responding, fed by h2's client side
    with windows of 2**31 - 1 so flow control never queues the timed writes."""
    client = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
    client.initiate_connection()
    client.update_settings({h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: 2**31 - 1})
    client.increment_flow_control_window(2**31 - 1 - 65535)
    session = H2Session(Limits(max_concurrent_streams=max(num_streams, 1)))
    stream_ids = [2 * i + 1 for i in range(num_streams)]
    for sid in stream_ids:
        client.send_headers(sid, [(":method", "POST"), (":scheme", "http"), (":authority", "bench"),
                                  (":path", "/v1/completions")], end_stream=True)
    session.receive_data(client.data_to_send())
    client.receive_data(session.data_to_send())
    session.receive_data(client.data_to_send())         # SETTINGS ACK
    for sid in stream_ids:
        session.start_response(sid, 200, [(b"content-type", b"text/event-stream")])
    session.data_to_send()
    return session, stream_ids


def dispatch_stages(s: Setup) -> list:
    """`Dispatcher.write_step` for one engine step of later tokens, as the loop runs it: SSE
    (the step's columns, spliced, one send_batch per connection) and NDJSON (rows: the
    encoder and one send_data per token), the streams spread over up to 4 connections.
    A connection's flush takes the session's bytes and drops them."""
    out = []
    for kind in ("SSE", "NDJSON"):
        for batch in s.batch_sizes:
            write_step, step = _dispatcher_step(kind, batch)
            out.append(Stage(f"Dispatcher.write_step, {kind} ({batch} streams)", "wire", partial(write_step, step),
                             num_tokens=batch, note="later tokens; frames to the session, no socket"))
    return out


class SocketlessConnection:
    """The part of a ServerProtocol the step writer uses, without a socket."""
    transport = None

    def __init__(self, session: H2Session):
        self.session = session
        self.outbox = Outbox(self)

    def flush(self) -> None:
        self.session.data_to_send()
        _open_windows(self.session)


def _dispatcher_step(kind: str, num_streams: int) -> tuple:
    """A Dispatcher with `num_streams` streaming exchanges past their first token, and one step
    of a token for each. -> (write_step, step)"""
    d = Dispatcher(Metrics())
    step = StepTokens([], 0)
    num_conns = min(num_streams, 4)
    for c in range(num_conns):
        n = num_streams // num_conns + (c < num_streams % num_conns)
        session, stream_ids = _open_h2_session(n)
        conn = SocketlessConnection(session)
        for sid in stream_ids:
            rid = len(d.exchanges) + 1
            enc = encoders.CompletionSse(f"cmpl-{rid}", 1700000000, "model", False, lambda i: " the") \
                if kind == "SSE" else encoders.Ndjson()
            ex = Exchange(rid, conn, sid, _COMPLETION, enc, True, Timeline(arrived_ns=0), f"cmpl-{rid}",
                          1700000000, False)
            ex.last_ns = 1                  # a later token, not the first
            d.add(ex)
            if kind == "SSE":
                step.request_ids.append(rid)
                step.token_ids.append(1234)
                step.texts.append(" the")
            else:
                step.rows.append(RequestOutput(rid, (1234,), " the", None, None, 0, 0, 0))
    return d.write_step, step


def socket_stages(s: Setup) -> list:
    """send() of one chunk on a loopback TCP connection; a thread drains the other end."""
    listener = socket.create_server(("127.0.0.1", 0))
    sender = socket.create_connection(listener.getsockname())
    receiver, _ = listener.accept()
    listener.close()
    sender.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    threading.Thread(target=_drain, args=(receiver,), daemon=True).start()
    payload = s.payload
    return [Stage(f"loopback socket send ({len(payload)} B)", "wire", lambda: sender.send(payload) and None,
                  note="TCP_NODELAY; a thread drains the peer")]


def _drain(sock: socket.socket) -> None:
    with sock:
        while sock.recv(1 << 20):
            pass


def handoff_stages(s: Setup) -> list:
    """Engine thread -> event loop -> engine thread, the way the server hands a step over
    (net/writer/dispatch.py): the engine rings a doorbell the loop watches (add_reader), the loop
    takes the step and rings a second doorbell the engine waits on. Both rings release the
    GIL (core/engine_core.Doorbell)."""
    try:
        import uvloop  # the server's loop
        loop = uvloop.new_event_loop()
    except ImportError:
        loop = asyncio.new_event_loop()
    step_ready, step_taken = Doorbell(), Doorbell()
    stamp = [0]

    def on_loop():
        step_ready.wait()                               # consume the ring, as the dispatcher does
        stamp[0] = time.perf_counter_ns()
        step_taken.ring()

    loop.add_reader(step_ready.fileno(), on_loop)
    threading.Thread(target=loop.run_forever, daemon=True).start()

    def handoff():
        t0 = time.perf_counter_ns()
        step_ready.ring()
        step_taken.wait()
        return stamp[0] - t0

    return [Stage("engine -> loop hand-off (doorbell)", "stream", handoff,
                  note="until the loop runs the step; the engine waits for it to be taken; once per step")]


# in the order a token meets them: the engine thread detokenizes, then hands the step to the loop
BUILDERS = (request_stages, scheduler_stages, engine_stages, sampling_stages, detokenize_stages, handoff_stages,
            encode_stages, session_stages, framing_stages, dispatch_stages, socket_stages)
