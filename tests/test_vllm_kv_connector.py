"""UzipConnector end to end on CPU: a real prefill + decode pair of `vllm serve` processes with
the tiny Gemma-3 (2 layers, random weights, real tokenizer), the `uzip_vllm.disagg` proxy in
this process. One pair serves the module (each vLLM start-up costs about a minute here).

Ground truth is the prefill instance asked directly (a plain single instance: it takes part in
a transfer only when a request carries `kv_transfer_params`), before any disaggregated request.
While `test_hold_file` exists the senders hold every layer after the first, so the kill test
kills the prefill instance while its transfer is certainly half done.
"""

import asyncio
import json
import os
import signal
import threading
import time
import urllib.request
from contextlib import ExitStack

import pytest

from conftest import use_vllm_test_env

use_vllm_test_env()  # before vllm is imported

vllm = pytest.importorskip("vllm")
pytest.importorskip("ucxx")
pytest.importorskip("aiohttp")

from benchmarks import realdata  # noqa: E402
from uzip_vllm import demo, disagg, kv_connector, kv_wire  # noqa: E402

PROMPTS = ["Once upon a time, in a small village, there lived an old clockmaker who",
           "The capital of France is",
           " ".join(f"word{i}" for i in range(150))]  # spans many 16-token blocks
MAX_TOKENS = 12
# The tiny model's sliding-window layer keeps 32 tokens here, so PROMPTS[2] (about 300 tokens, three
# 128-token CPU blocks) is sent without that layer's first two blocks; the decode side fills them
# with NaN, so attention that read them would show in the output (trimming one block more does).
WINDOW = 32
LOAD_TIMEOUT_S = 15.0


def _post(url, body, timeout=120):
    return demo.http_json(url + "/v1/completions", body, timeout=timeout)[0]


def _complete(url, model, prompt, **extra):
    body = {"model": model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, **extra}
    return _post(url, body)["choices"][0]["text"]


def _get(url):
    with urllib.request.urlopen(url, timeout=30) as r:
        return r.read().decode()


def _counters(pair_ns, role):
    path = os.path.join(pair_ns.stats_dir, f"{role}-tp0.json")
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return {"counters": {}, "xfers": {}}


def _p2p_hits(metrics_text):
    for line in metrics_text.splitlines():
        if line.startswith("vllm:prompt_tokens_cached_by_source_total") and 'source="p2p"' in line:
            return float(line.rsplit(" ", 1)[1])
    return 0.0


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    model = str(realdata.tiny_dir())
    if not os.path.isdir(model):
        pytest.fail("the tiny model is missing: run `make setup` (python -m benchmarks.realdata)")
    work = tmp_path_factory.mktemp("disagg")
    with ExitStack() as stack:
        p = disagg.start_pair(stack, model, work, compression="on", policy="recompute",
                              extra_extra={"load_timeout_s": LOAD_TIMEOUT_S, "test_hold_file": str(work / "hold"),
                                           "test_poison_untransferred": True},
                              vllm_args=["--hf-overrides", json.dumps({"sliding_window": WINDOW})])
        proxy = disagg.Proxy(p.prefill_url, p.decode_url, p.stats_dir)
        port = demo.free_port()
        loop = asyncio.new_event_loop()
        stop = asyncio.Event()
        t = threading.Thread(target=lambda: loop.run_until_complete(
            disagg.serve_proxy(proxy, "127.0.0.1", port, stop)), daemon=True)
        t.start()
        url = f"http://127.0.0.1:{port}"
        for _ in range(100):
            try:
                _get(url + "/uzip/disagg/stats")
                break
            except OSError:
                time.sleep(0.1)
        stack.callback(lambda: (loop.call_soon_threadsafe(stop.set), t.join(10)))
        ref = {prompt: _complete(p.prefill_url, model, prompt) for prompt in PROMPTS}
        yield type("Pair", (), dict(model=model, proxy=url, prefill_url=p.prefill_url, decode_url=p.decode_url,
                                    stats_dir=p.stats_dir, prefill_proc=p.prefill_proc, ref=ref, work=work,
                                    hold=work / "hold"))


def test_greedy_outputs_equal_single_instance(pair):
    for prompt in PROMPTS:
        assert _complete(pair.proxy, pair.model, prompt) == pair.ref[prompt], prompt
    # Streaming goes through the proxy too.
    body = {"model": pair.model, "prompt": PROMPTS[0], "max_tokens": MAX_TOKENS, "temperature": 0, "stream": True}
    req = urllib.request.Request(pair.proxy + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"content-type": "application/json"})
    text = ""
    with urllib.request.urlopen(req, timeout=120) as r:
        for line in r.read().decode().splitlines():
            if line.startswith("data: ") and line != "data: [DONE]":
                text += json.loads(line[6:])["choices"][0]["text"]
    assert text == pair.ref[PROMPTS[0]]


def test_decode_used_transferred_kv(pair):
    before = _counters(pair, "decode")["counters"]
    sender_before = _counters(pair, "prefill")["counters"]
    hits_before = _p2p_hits(_get(pair.decode_url + "/metrics"))
    prompt = PROMPTS[2] + " again"
    assert _complete(pair.proxy, pair.model, prompt) == _complete(pair.prefill_url, pair.model, prompt)
    # The decode worker wrote transferred blocks into its cache ... (its stats file is written a
    # few ms after the load by a writer thread, which a loaded CI host may run after the answer)
    deadline = time.monotonic() + 30
    while (after := _counters(pair, "decode")["counters"]).get("loads_ok", 0) == before.get("loads_ok", 0):
        assert time.monotonic() < deadline, "no load was counted"
        time.sleep(0.05)
    assert after.get("loads_ok", 0) == before.get("loads_ok", 0) + 1
    assert after.get("tokens_loaded", 0) > before.get("tokens_loaded", 0) + 100
    assert after.get("recv_wire_bytes", 0) > before.get("recv_wire_bytes", 0)
    # Every layer of it went into the paged cache, on arrival or (load registered late) in the step.
    written = sum(after.get(k, 0) - before.get(k, 0) for k in ("layers_on_arrival", "layers_in_step"))
    assert written == 2  # the tiny Gemma-3's two layers
    # The sliding-window layer went trimmed to its window (decode runs without prefix caching).
    # The sender counts a transfer once its last send returns, which can come seconds after
    # decode answered (and after the next test began: the earlier, untrimmed transfers count late).
    deadline = time.monotonic() + 30
    skipped_before = sender_before.get("send_window_skipped_bytes", 0)
    while _counters(pair, "prefill")["counters"].get("send_window_skipped_bytes", 0) <= skipped_before:
        assert time.monotonic() < deadline, "the sliding-window layer was not trimmed"
        time.sleep(0.05)
    # ... and vLLM's own counter attributes those prompt tokens to a p2p transfer (its metrics
    # reach the API server with the engine's next stats update).
    while _p2p_hits(_get(pair.decode_url + "/metrics")) <= hits_before:
        assert time.monotonic() < deadline, "vLLM counted no p2p cache hit"
        time.sleep(0.05)
    # The proxy's stats route exposes the same counters.
    stats = json.loads(_get(pair.proxy + "/uzip/disagg/stats"))
    assert stats["workers"]["decode-tp0"]["loads_ok"] >= 1
    assert stats["workers"]["prefill-tp0"]["sends_ok"] >= 1


def test_prefill_killed_mid_transfer_recomputes(pair):
    """Last in the module: it kills the prefill instance."""
    before = _counters(pair, "decode")["counters"]
    began_before = sum("t_recv_first" in x for x in _counters(pair, "decode")["xfers"].values())
    prompt = PROMPTS[2] + " killed"
    want = _complete(pair.decode_url, pair.model, prompt)  # decode alone, no transfer
    result = {}

    def run():
        t0 = time.monotonic()
        try:
            result["text"] = _complete(pair.proxy, pair.model, prompt)
        except Exception as e:  # noqa: BLE001
            result["error"] = e
        result["seconds"] = time.monotonic() - t0

    # The decode worker notes a transfer's first message (the hello and layer 0: the prefill's
    # sender holds every later layer while the hold file exists): kill it there.
    pair.hold.touch()
    try:
        th = threading.Thread(target=run)
        th.start()
        deadline = time.monotonic() + 60
        while sum("t_recv_first" in x for x in _counters(pair, "decode")["xfers"].values()) == began_before:
            assert time.monotonic() < deadline, "the transfer never reached the decode instance"
            time.sleep(0.05)
        os.killpg(pair.prefill_proc.pid, signal.SIGKILL)
    finally:
        pair.hold.unlink()
    th.join(LOAD_TIMEOUT_S + 60)
    assert not th.is_alive(), "the request hung after the prefill instance died"
    # Recomputed (policy "recompute"): the right answer, within the load deadline plus compute.
    assert "error" not in result, result
    assert result["text"] == want
    after = _counters(pair, "decode")["counters"]
    assert after.get("loads_failed", 0) == before.get("loads_failed", 0) + 1
    assert after.get("loads_ok", 0) == before.get("loads_ok", 0)
    cut = [x for x in _counters(pair, "decode")["xfers"].values() if "t_recv_first" in x and "t_injected" not in x]
    # The decode worker saw the peer die (UCX), not the load deadline pass ("no complete KV within").
    assert len(cut) == 1 and cut[0]["first_layers"] == 1 and "PeerError" in cut[0]["error"], cut
    # The decode instance keeps serving.
    assert _complete(pair.decode_url, pair.model, PROMPTS[1]) == pair.ref[PROMPTS[1]]


# ---- no vLLM start-up: the control messages and the layout check ---------------------------------

def test_hello_roundtrip_and_validation():
    h = kv_wire.Hello(kv_wire.KIND_TRANSFER, 2, 1, 18, 1, 16, 1000, 63, 8192, "ab" * 16)
    assert len(h.pack()) == kv_wire.HELLO.size == 68
    assert kv_wire.Hello.unpack(h.pack()) == h
    bad = bytearray(h.pack())
    bad[0:4] = b"XXXX"
    with pytest.raises(ValueError, match="magic"):
        kv_wire.Hello.unpack(bytes(bad))
    with pytest.raises(ValueError):
        kv_wire.Hello.unpack(h.pack()[:-1])
    assert kv_wire.unpack_reply(kv_wire.pack_reply(None)) == (None, 0)
    reason, _ = kv_wire.unpack_reply(kv_wire.pack_reply("TP differs"))
    assert "TP" in reason
    assert kv_wire.unpack_reply(kv_wire.pack_reply(None, kv_wire.REPLY_WINDOW_TRIM)) == (
        None, kv_wire.REPLY_WINDOW_TRIM)
    old = bytearray(h.pack())
    old[4:6] = (2).to_bytes(2, "little")  # version 2 always sent whole layers and had no reply flags
    with pytest.raises(ValueError, match="version 2"):
        kv_wire.Hello.unpack(bytes(old))


def test_window_first_block():
    f = kv_wire.window_first_block
    assert f(4095, None, 16) == 0 and f(4095, 0, 16) == 0  # full attention: every block
    assert f(300, 512, 16) == 0                           # the prompt fits in the window
    assert f(4095, 512, 16) == (4095 - 512) // 16 == 223  # decode computes position 4095: keys from 3584
    assert f(100, 32, 16) == 4                            # keys 68.. are read: blocks 4, 5, 6 stay


def test_different_tp_is_refused():
    import torch

    c = kv_connector.UzipConnector.__new__(kv_connector.UzipConnector)
    c._tp_size, c._tp_rank, c._block_size = 1, 0, 16
    c._layer_names, c._dtype, c._page_nbytes = ["a", "b"], torch.bfloat16, 8192
    ok = c._hello(kv_wire.KIND_PROBE)
    assert c._check_hello(ok) is None
    tp2 = kv_wire.Hello(kv_wire.KIND_PROBE, 2, 0, 2, 1, 16, 0, 0, 8192, "")
    assert "tensor-parallel sizes differ" in c._check_hello(tp2)
    other_layout = kv_wire.Hello(kv_wire.KIND_PROBE, 1, 0, 2, 1, 32, 0, 0, 8192, "")
    assert "block_size" in c._check_hello(other_layout)


def test_config_errors_name_the_field():
    with pytest.raises(ValueError, match="peer"):
        kv_connector.parse_config({}, "kv_producer")
    with pytest.raises(ValueError, match="unknown"):
        kv_connector.parse_config({"bogus": 1}, "kv_consumer")
    with pytest.raises(ValueError, match="kv_both|kv_role"):
        kv_connector.parse_config({}, "kv_both")
    cfg = kv_connector.parse_config({"peer": "h:5", "load_timeout_s": 3}, "kv_producer")
    assert cfg.peer_host_port == ("h", 5) and cfg.load_timeout_s == 3.0
    assert kv_connector.parse_config({"peer": "h:5"}, "kv_producer").overlap is True
    for text, want in (("false", False), ("0", False), (False, False), ("True", True)):
        assert kv_connector.parse_config({"peer": "h:5", "overlap": text}, "kv_producer").overlap is want
    with pytest.raises(ValueError, match="overlap.*boolean"):
        kv_connector.parse_config({"peer": "h:5", "overlap": "sometimes"}, "kv_producer")
    with pytest.raises(ValueError, match="progress_mode must be thread"):
        kv_connector.parse_config({"listen": "h:5", "progress_mode": "blocking"}, "kv_consumer")
    assert kv_connector.parse_config({"peer": "h:5", "progress_mode": "thread-polling"},
                                     "kv_producer").progress_mode == "thread-polling"
    # Chunks go eagerly by default: the threshold covers the largest chunk on the wire.
    from uzip_serve import format as fmt

    t = kv_connector.parse_config({"listen": "h:5", "chunk_bytes": 1 << 19}, "kv_consumer").transport()
    assert t.eager_bytes == fmt.max_compressed_size(1 << 19, "uint8") >= 1 << 19 and t.chunk_bytes == 1 << 19
    assert t.cuda_ipc == "off" and t.progress_mode == "thread"
    assert kv_connector.parse_config({"listen": "h:5", "ucx_eager": "false"}, "kv_consumer").transport().eager_bytes == 0


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity") or len(os.sched_getaffinity(os.getppid())) < 2,
                    reason="needs CPU affinity and two CPUs")
def test_connector_threads_do_not_inherit_a_pinned_main_thread():
    """vLLM's CPU worker pins its main thread to one core; threads the connector starts from it
    (and UCX's, started there) must run on the instance's CPUs, and the main thread stays pinned."""
    from concurrent.futures import ThreadPoolExecutor

    seen = {}

    def worker_main():
        os.sched_setaffinity(0, {0})  # as vLLM's init_cpu_threads_env leaves the OpenMP master
        with kv_connector._threads_start_unpinned():
            t = threading.Thread(target=lambda: seen.__setitem__("started", os.sched_getaffinity(0)))
            t.start()
            t.join()
        seen["main_after"] = os.sched_getaffinity(0)
        t = threading.Thread(target=lambda: seen.__setitem__("started_after", os.sched_getaffinity(0)))
        t.start()
        t.join()
        with ThreadPoolExecutor(1, initializer=kv_connector._unpin_this_thread) as pool:
            seen["pool"] = pool.submit(os.sched_getaffinity, 0).result()

    main = threading.Thread(target=worker_main)
    main.start()
    main.join()
    wide = os.sched_getaffinity(os.getppid()) | {0}
    assert seen == {"started": wide, "main_after": {0}, "started_after": {0}, "pool": wide}


def test_idle_steps_wait_longer_for_an_arrival():
    """A step that schedules nothing, while a load is pending, waits up to idle_wait_ms for an
    arrival; a step with a forward waits 1 ms at most (it would hold up the running requests)."""
    from types import SimpleNamespace

    from benchmarks.disagg_link import _kv_connector

    sched = _kv_connector(listen="127.0.0.1:0")  # its scheduler half: nothing to send
    sched._to_send, sched._to_load = {}, {}
    assert sched.build_connector_meta(SimpleNamespace(num_scheduled_tokens={}, total_num_scheduled_tokens=0)).idle
    busy = sched.build_connector_meta(SimpleNamespace(num_scheduled_tokens={"r": 1}, total_num_scheduled_tokens=1))
    assert not busy.idle

    worker = _kv_connector(listen="127.0.0.1:0", idle_wait_ms=25.0)
    spec = kv_connector.LoadSpec("r1", "0" * 32, [0], 0, 10)
    worker._pending = {"r1": (spec, time.monotonic() + 60)}  # a load with nothing arrived yet
    waits = []
    worker._arrived = SimpleNamespace(wait=waits.append, clear=lambda: None)
    for idle in (True, False):
        worker.bind_connector_metadata(kv_connector.UzipConnectorMetadata(idle=idle))
        res = worker.get_transfer_results(set())
        worker.clear_connector_metadata()
        assert not res.finished_recving  # still pending, nothing failed
    assert waits == [0.025, 0.001]


def test_stats_file_follows_the_notes(tmp_path):
    """The stats file is written by a thread, shortly after the notes; flush writes it at once,
    and only the newest MAX_XFERS transfers are kept."""
    path = tmp_path / "decode-tp0.json"
    stats = kv_connector._Stats(str(path))
    for i in range(kv_connector._Stats.MAX_XFERS + 3):
        stats.note(f"x{i}", t_load_requested=float(i))
    stats.add(loads_ok=2)
    stats.add(loads_ok=1, tokens_loaded=100)
    deadline = time.monotonic() + 10
    while True:
        try:
            data = json.loads(path.read_text())
            if data["counters"].get("tokens_loaded") == 100:
                break
        except (OSError, ValueError):
            pass
        assert time.monotonic() < deadline, "the stats file never showed the notes"
        time.sleep(0.01)
    assert data["counters"] == {"loads_ok": 3, "tokens_loaded": 100}
    assert len(data["xfers"]) == kv_connector._Stats.MAX_XFERS and "x2" not in data["xfers"]
    assert data["xfers"][f"x{kv_connector._Stats.MAX_XFERS + 2}"] == {"t_load_requested": float(kv_connector._Stats.MAX_XFERS + 2)}
    stats.add(loads_failed=1)
    stats.flush()
    assert json.loads(path.read_text())["counters"]["loads_failed"] == 1
    assert kv_connector._Stats(None).flush() is None  # no stats_dir: nothing written, no thread


# ---- no vLLM start-up: the kept-open connection of the transfer path ---------------------------
# Worker halves as benchmarks/disagg_link.py builds them (Gemma-3-270M's CPU page layout, 18
# layers, TP=1), sender and receiver in this process or the receiver in a child process.

NUM_TOKENS = 100  # 7 blocks of 16: a partial last block


def _sender(port, **cfg):
    from benchmarks.disagg_link import _kv_connector

    return _kv_connector(peer=f"127.0.0.1:{port}", compression="on", **cfg)


def _receiver(**cfg):
    from benchmarks.disagg_link import _kv_connector

    r = _kv_connector(listen="127.0.0.1:0", **cfg)
    r._start_listener()
    return r


def _layers(seed):
    """bf16 KV-like layers (normal values: the codec has exponents to compress)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    nblk = -(-NUM_TOKENS // 16)
    return [torch.randn(nblk, 1, 16, 512, generator=g).to(torch.bfloat16) for _ in range(18)]


def _send(s, layers, first=lambda i: 0):
    """One transfer through the sender's own path; returns its xfer id and its stats record.
    first(i): blocks of layer i left out when it was saved (0: saved whole, as before the
    peer's reply is known)."""
    import uuid

    xfer = uuid.uuid4().hex
    out = kv_connector._Outgoing(kv_connector.SaveSpec("r", xfer, list(range(layers[0].shape[0])), NUM_TOKENS))
    for i, b in enumerate(layers):
        out.q.put((i, first(i), b[first(i):]))
    out.q.put(kv_connector._END)
    s._send_one(out)
    return xfer, s._stats.xfers[xfer]


def _received(r, xfer, timeout=10.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with r._incoming_lock:
            entry = r._incoming.get(xfer)
        if entry is not None and (entry.done or entry.error):
            return entry
        time.sleep(0.01)
    raise AssertionError(f"transfer {xfer} never completed on the receiver")


def _assert_bitwise(entry, layers):
    assert entry.error is None and sorted(entry.layers) == list(range(len(layers)))
    for i, want in enumerate(layers):
        got = entry.layers[i]
        assert got.dtype == want.dtype and got.shape == want.shape
        assert torch_equal_bits(got, want), f"layer {i} differs"


def torch_equal_bits(a, b):
    import torch

    return torch.equal(a.view(torch.int16), b.view(torch.int16))


def test_transfers_reuse_one_connection():
    r = _receiver()
    s = _sender(r._listener.port)
    try:
        for seed in range(3):
            layers = _layers(seed)
            xfer, rec = _send(s, layers)
            assert "error" not in rec, rec
            _assert_bitwise(_received(r, xfer), layers)
        # Three transfers, one connection: one connect on the prefill side, one session on the decode side.
        assert s._stats.counters.get("connects") == 1
        assert s._stats.counters.get("reconnects", 0) == 0
        assert s._stats.counters.get("sends_ok") == 3
        assert r._stats.counters.get("sessions") == 1
    finally:
        s.shutdown()
        r.shutdown()


def test_layers_land_in_the_cache_as_they_arrive():
    """With the load registered before the KV comes (the usual case), each layer is written into
    the paged cache by the receiver as soon as it is in, and the engine's step has nothing left
    to write; a load given up (timed out) is never written to after that."""
    import torch

    r = _receiver()
    s = _sender(r._listener.port)
    try:
        nblk = -(-NUM_TOKENS // 16)
        r._kv = {n: torch.zeros(12, 1, 16, 512, dtype=torch.bfloat16) for n in r._layer_names}
        table = [11, 3, 5, 7, 9, 1, 0][:nblk]
        layers = _layers(7)
        xfer = "a" * 32
        spec = kv_connector.LoadSpec("r1", xfer, table, 0, NUM_TOKENS)
        r._register_load(spec, time.monotonic() + 60)
        r.bind_connector_metadata(kv_connector.UzipConnectorMetadata())  # a step without new loads
        out = kv_connector._Outgoing(kv_connector.SaveSpec("r1", xfer, list(range(nblk)), NUM_TOKENS))
        for i, b in enumerate(layers):
            out.q.put((i, 0, b))
        out.q.put(kv_connector._END)
        s._send_one(out)
        entry = _received(r, xfer)
        assert entry.error is None and entry.written == set(range(18)) and not entry.layers
        assert r._stats.counters["layers_on_arrival"] == 18
        for i, name in enumerate(r._layer_names):
            for j, blk in enumerate(table):
                assert torch_equal_bits(r._kv[name][blk], layers[i][j]), (i, j)
        res = r.get_transfer_results(set())
        assert res.finished_recving == {"r1"} and not res.failed_recving
        assert r._stats.counters["loads_ok"] == 1 and not r._load_specs

        # A load that timed out: reported failed, and a layer that comes later is not written.
        late = kv_connector.LoadSpec("r2", "b" * 32, table, 0, NUM_TOKENS)
        r._register_load(late, time.monotonic() - 1)
        hello = s._hello(kv_wire.KIND_TRANSFER, late.xfer_id, NUM_TOKENS, nblk)
        entry = kv_connector._Incoming(hello, time.time())
        with r._incoming_lock:
            r._incoming[late.xfer_id] = entry
        r._attach(entry, late)
        r._arrive(entry, 0, "0", torch.ones(nblk, 1, 16, 512, dtype=torch.bfloat16))
        assert entry.written == {0}
        res = r.get_transfer_results(set())
        assert res.failed_recving == {"r2"} and entry.abandoned
        before = r._kv[r._layer_names[1]].clone()
        r._arrive(entry, 0, "1", torch.ones(nblk, 1, 16, 512, dtype=torch.bfloat16))
        assert entry.written == {0} and torch.equal(r._kv[r._layer_names[1]], before)
        with pytest.raises(ValueError, match="unexpected message"):  # checked before anything is written
            r._arrive(entry, 0, "2", torch.ones(nblk, 1, 16, 256, dtype=torch.bfloat16))
    finally:
        s.shutdown()
        r.shutdown()


# A Gemma-3-like layout with a 32-token window: layers 5, 11 and 17 are global. At NUM_TOKENS = 100
# a windowed layer needs keys from position 68 on: blocks 4-6 of 0-6.
SMALL_WINDOWS = [None if i % 6 == 5 else 32 for i in range(18)]
TRIM = kv_wire.window_first_block(NUM_TOKENS, 32, 16)


def _trimming_pair(allow, **receiver_cfg):
    r = _receiver(**receiver_cfg)
    r._windows, r._allow_trim = list(SMALL_WINDOWS), allow
    s = _sender(r._listener.port)
    s._windows = list(SMALL_WINDOWS)
    return r, s


def test_sliding_window_layers_go_trimmed_and_land_in_place():
    import torch

    r, s = _trimming_pair(True, test_poison_untransferred=True)
    try:
        layers = _layers(3)
        xfer, rec = _send(s, layers)
        assert "error" not in rec, rec
        entry = _received(r, xfer)
        assert TRIM == 4 and s._peer_trim
        _assert_bitwise(entry, [b[TRIM:] if w else b for b, w in zip(layers, SMALL_WINDOWS)])
        page = s._page_nbytes
        assert rec["raw_bytes"] == (3 * 7 + 15 * (7 - TRIM)) * page
        assert s._stats.counters["send_window_skipped_bytes"] == 15 * TRIM * page
        # Into a paged cache: each layer's blocks where the block table says; what a windowed
        # layer did not get is filled with NaN (test_poison_untransferred); other blocks untouched.
        for first_pos in (0, 5):  # 5: the first five blocks were local prefix-cache hits
            r._kv = {n: torch.zeros(12, 1, 16, 512, dtype=torch.bfloat16) for n in r._layer_names}
            table = [11, 3, 5, 7, 9, 1, 0]
            arrived = kv_connector._Incoming(entry.hello, entry.t_begin, layers=dict(entry.layers), done=True)
            r._inject(kv_connector.LoadSpec("r", xfer, table, first_pos, NUM_TOKENS), arrived)
            for i, name in enumerate(r._layer_names):
                kv = r._kv[name]
                for j, blk in enumerate(table):
                    if j < first_pos:
                        assert not kv[blk].any(), (i, j)
                    elif SMALL_WINDOWS[i] and j < TRIM:
                        assert kv[blk].isnan().all(), (i, j)
                    else:
                        assert torch_equal_bits(kv[blk], layers[i][j]), (i, j)
                for blk in (2, 4, 6, 8, 10):
                    assert not kv[blk].any()
    finally:
        s.shutdown()
        r.shutdown()


def test_decode_with_prefix_caching_takes_whole_layers_only():
    """A decode side that does not allow trimming (prefix caching on) gets whole layers; a
    sender that trims anyway is refused inside the transfer, replaces the connection once, and
    the new session's reply makes it send the same transfer whole."""
    r, s = _trimming_pair(False)
    try:
        layers = _layers(4)
        xfer, rec = _send(s, layers)
        assert "error" not in rec, rec
        _assert_bitwise(_received(r, xfer), layers)
        assert not s._peer_trim and s._stats.counters["send_window_skipped_bytes"] == 0
        s._peer_trim = True  # as if it had missed the decode side's reply
        xfer, rec = _send(s, layers)
        assert "error" not in rec, rec
        _assert_bitwise(_received(r, xfer), layers)
        assert not s._peer_trim and s._stats.counters["reconnects"] == 1 and s._stats.counters["connects"] == 2
        xfer, rec = _send(s, layers)  # and the next one on the new connection
        assert "error" not in rec, rec
        _assert_bitwise(_received(r, xfer), layers)
    finally:
        s.shutdown()
        r.shutdown()


def test_layers_saved_trimmed_fail_cleanly_when_the_peer_wants_them_whole():
    """The decode instance came back with prefix caching on between a layer's save (trimmed,
    per the last reply) and its send: that transfer fails (decode applies its load-failure
    policy) and the next one, saved whole, goes through on the same connection."""
    r, s = _trimming_pair(False)
    try:
        layers = _layers(5)
        s._peer_trim = True  # what the start-up probe said, before the decode side restarted
        _, rec = _send(s, layers, first=lambda i: TRIM if SMALL_WINDOWS[i] else 0)
        assert "wants every block" in rec["error"]
        xfer, rec = _send(s, layers)
        assert "error" not in rec, rec
        _assert_bitwise(_received(r, xfer), layers)
        assert s._stats.counters.get("connects") == 1
    finally:
        s.shutdown()
        r.shutdown()


@pytest.mark.parametrize("noticed", [True, False], ids=["seen-idle", "seen-on-send"])
def test_broken_kept_connection_is_replaced(noticed, monkeypatch):
    from uzip_serve.p2p import sync

    r = _receiver()
    s = _sender(r._listener.port)
    try:
        layers = _layers(0)
        xfer, _ = _send(s, layers)
        _assert_bitwise(_received(r, xfer), layers)
        # The decode side drops the connection (as a restarted decode worker would have).
        for ep in list(r._sessions):
            ep.abort()
        if not noticed:  # as if UCX had not seen it yet: the transfer's first send finds out
            monkeypatch.setattr(sync.SyncEndpoint, "alive", property(lambda self: True))
        layers = _layers(1)
        xfer, rec = _send(s, layers)
        assert "error" not in rec, rec
        _assert_bitwise(_received(r, xfer), layers)
        assert s._stats.counters.get("connects") == 2
        assert s._stats.counters.get("reconnects") == 1
    finally:
        s.shutdown()
        r.shutdown()


def test_dead_decode_peer_fails_the_transfer_within_the_deadline(tmp_path):
    """The decode process is killed with a kept connection open: the next transfer fails (the
    decode side's failure policy applies there) within the deadline instead of hanging; a decode
    process started again on the same port gets the transfer after that."""
    import subprocess
    import sys

    from uzip_vllm import demo

    port = demo.free_port()
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([repo, os.path.join(repo, "integrations", "vllm"),
                                                        os.environ.get("PYTHONPATH", "")])}
    script = ("import time\nfrom benchmarks.disagg_link import _kv_connector\n"
              f"c = _kv_connector(listen='127.0.0.1:{port}')\nc._start_listener()\n"
              "print('READY', flush=True)\ntime.sleep(600)\n")

    def decode_process():
        p = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, env=env,
                             **demo.NEW_PROCESS_GROUP)
        assert p.stdout.readline().strip() == "READY"
        return p

    deadline_s = 3.0
    s = _sender(port, deadline_s=deadline_s)
    proc = decode_process()
    try:
        _, rec = _send(s, _layers(0))
        assert "error" not in rec, rec
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        t0 = time.monotonic()
        _, rec = _send(s, _layers(1))
        took = time.monotonic() - t0
        assert "error" in rec
        assert s._stats.counters.get("sends_failed") == 1
        assert took < 2 * deadline_s + 2, f"the failed transfer took {took:.1f} s"
        proc = decode_process()
        _, rec = _send(s, _layers(2))
        assert "error" not in rec, rec
        assert s._stats.counters.get("connects") == 2
    finally:
        s.shutdown()
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "after-forward"])
def test_overlap_decides_when_the_sender_starts(overlap):
    """Through save_kv_layer / wait_for_save, as vLLM's forward calls them: with overlap the
    sender starts at the first layer; with overlap=false (uzip bench disagg --no-overlap)
    nothing leaves before the forward is done, and then every layer arrives intact."""
    import uuid
    from concurrent.futures import ThreadPoolExecutor

    r = _receiver()
    s = _sender(r._listener.port, overlap=overlap)
    s._sender = ThreadPoolExecutor(max_workers=2)
    s._outgoing = {}
    s._layer_index = {n: i for i, n in enumerate(s._layer_names)}
    started = threading.Event()
    send_one = s._send_one
    s._send_one = lambda out: (started.set(), send_one(out))
    try:
        layers = _layers(7)
        xfer = uuid.uuid4().hex
        spec = kv_connector.SaveSpec("r", xfer, list(range(layers[0].shape[0])), NUM_TOKENS)
        s.bind_connector_metadata(kv_connector.UzipConnectorMetadata(saves=[spec]))
        for name, layer in zip(s._layer_names[:-1], layers[:-1]):
            s.save_kv_layer(name, layer, None)
        assert started.wait(0.5 if overlap else 0.3) is overlap
        s.save_kv_layer(s._layer_names[-1], layers[-1], None)
        s.wait_for_save()
        assert started.wait(5)
        _assert_bitwise(_received(r, xfer), layers)
    finally:
        s.clear_connector_metadata()
        s.shutdown()
        r.shutdown()
