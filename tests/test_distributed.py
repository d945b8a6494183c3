"""One model over several processes (`ds4_mlx.distributed`): 2 and 3 ranks started by `mlx.launch` on this
machine (the ring backend over loopback TCP) give the logits one process gives, through prefills, decoded
tokens, rewinds of every depth, resends, snapshots, sessions decoded together, a save and a load after a
restart; `generate` and the server give the same text; a rank killed mid-request, or one that stops
answering, stops rank 0 with a clear error."""

import itertools
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from test_drafter_gguf import dspark_metadata, dspark_tensors, mtp_tensors

from ds4_mlx.distributed import plan_layers, plan_model
from ds4_mlx.loader import load
from ds4_mlx.models.gguf_names import held_name
from ds4_mlx.session import Session
from ds4_mlx.tools import pipeline_check as check
from ds4_mlx.tools.drafters import random_dspark, random_mtp
from ds4_mlx.tools.testing import free_ports, gguf_metadata, run_launch, tiny_args, tiny_pro_args, write_gguf

REPO = Path(__file__).resolve().parent.parent
LAUNCH = Path(sys.executable).parent / "mlx.launch"
TOLERANCE = 1e-5
pytestmark = pytest.mark.skipif(not LAUNCH.exists() or not mx.distributed.is_available(),
                                reason="needs mlx.launch and MLX's distributed layer")


def launch_command(ranks, *command):
    return [str(LAUNCH), "-n", str(ranks), "--hosts", "127.0.0.1", "--backend", "ring",
            "--starting-port", str(free_ports(ranks)), "--env", f"PYTHONPATH={REPO}",
            "--env", f"DS4_MLX_HOME={os.environ.get('DS4_MLX_HOME', '')}",
            "--env", f"DS4_MLX_RANK_TIMEOUT={os.environ.get('DS4_MLX_RANK_TIMEOUT', '600')}", "--", sys.executable, *command]


def launched(ranks, *command, timeout=120):
    """mlx.launch's run of `command` on `ranks` ranks (`run_launch`)."""
    return run_launch(lambda: launch_command(ranks, *command), timeout)


def launch(ranks, *command, timeout=120):
    done = launched(ranks, *command, timeout=timeout)
    assert done.returncode == 0 and "exited with code" not in done.stderr, done.stdout + done.stderr
    return done


def launched_script(ranks, model, out, *flags):
    out.mkdir(parents=True, exist_ok=True)
    launch(ranks, "-m", "ds4_mlx.tools.pipeline_check", str(model), str(out), *flags)
    return dict(np.load(out / "logits.npz"))


@pytest.fixture(scope="module")
def models(tmp_path_factory, demo):
    """{name: path}: the tiny config, the PRO-shaped one (random weights, as GGUF files) and the demo model."""
    from ds4_mlx.demo import demo_model_path, random_gguf_tensors

    folder = tmp_path_factory.mktemp("pipeline")
    paths = {"demo": demo_model_path()}
    for name, args in (("tiny", tiny_args()), ("pro", tiny_pro_args())):
        paths[name] = write_gguf(folder / f"{name}.gguf", gguf_metadata(args), random_gguf_tensors(args))
    return paths


def one_process(path, run=check.script, *extra):
    model, _ = load(path)
    session = Session(model, **check.SESSION_OPTIONS)
    return run(session, check.prompt_ids(model.args.vocab_size), *extra)


def assert_same(got, expected):
    assert set(got) == set(expected)
    for name, want in expected.items():
        diff = np.abs(got[name].astype(np.float64) - want).max()
        assert diff <= TOLERANCE, f"{name}: max |diff| {diff:.2e}"


# the tiny model on 2 ranks runs the same script in test_exact_rewinds_equal_one_process; the demo model
# through generate
@pytest.mark.parametrize("model,ranks,idle", [("pro", 3, 10)])
def test_logits_equal_one_process(models, tmp_path, monkeypatch, model, ranks, idle):
    """`idle`: rank 0 waits longer than DS4_MLX_RANK_TIMEOUT before it starts: the others wait for its
    orders with no time limit (an idle server keeps its ranks). A prompt is also computed a few layers at a
    time beside another session's tokens, in pieces that end inside one rank's layers and at a boundary."""
    # shorter than the idle wait, and long enough for any exchange of a busy machine (the other ranks'
    # steps come before an agreement)
    monkeypatch.setenv("DS4_MLX_RANK_TIMEOUT", str(idle - 2) if idle else "600")
    expected = one_process(models[model])
    loaded, _ = load(models[model])
    ids = check.prompt_ids(loaded.args.vocab_size)
    expected.update(check.batched(lambda: Session(loaded, **check.SESSION_OPTIONS), ids))
    pieces = (1, 2, 3)
    for layers in pieces:
        expected.update(check.in_pieces(lambda: Session(loaded, **check.SESSION_OPTIONS), ids, layers))
    assert len([k for k in expected if k.startswith("beside1.")]) > loaded.args.num_hidden_layers
    # the script's rewinds take every path: in place, a lane, a checkpoint, from the start
    assert expected["rewind_in_place.replayed"] == 0
    assert 0 < expected["rewind_to_a_lane.replayed"] < 16 and 0 < expected["rewind_to_a_checkpoint.replayed"] < 16
    assert expected["rewind_to_the_start.replayed"] == 4 and expected["same_again.replayed"] == 0
    assert_same(launched_script(ranks, models[model], tmp_path, "--idle", str(idle), "--layers-per-turn",
                                *map(str, pieces)), expected)


def test_exact_rewinds_equal_one_process(models, tmp_path):
    """Sessions with exact rewinds (`serve --exact-rewinds`) never trim in place and replay from the chunk
    grid: 2 ranks replay the tokens one process replays and give its logits."""
    model, _ = load(models["tiny"])
    ids = check.prompt_ids(model.args.vocab_size)
    options = dict(check.SESSION_OPTIONS, exact_rewinds=True)
    expected = check.script(Session(model, **options), ids)
    expected.update(check.batched(lambda: Session(model, **options), ids))
    assert expected["rewind_in_place.replayed"] > 0 and expected["same_again.replayed"] == 0
    assert_same(launched_script(2, models["tiny"], tmp_path, "--exact-rewinds"), expected)


@pytest.fixture(scope="module")
def saved(models, tmp_path_factory):
    """A session of the tiny model saved by 2 ranks (its path), and the logits of the step after."""
    folder = tmp_path_factory.mktemp("saved")
    path = folder / "s.safetensors"
    return path, launched_script(2, models["tiny"], folder / "out", "--save", str(path))


def test_save_and_load_across_a_restart(models, saved, tmp_path):
    path, after_save = saved
    alone = tmp_path / "s.safetensors"
    assert_same(after_save, one_process(models["tiny"], check.saved_then_stepped, alone))
    assert path.exists() and Path(f"{path}.rank1").exists()  # each rank saves its own layers
    expected = one_process(models["tiny"], check.loaded_then_stepped, alone)
    assert_same(launched_script(2, models["tiny"], tmp_path / "load", "--load", str(path)), expected)


def test_a_part_that_does_not_fit_is_refused_on_every_rank(models, saved, tmp_path):
    path = tmp_path / "s.safetensors"
    path.write_bytes(saved[0].read_bytes())
    Path(f"{path}.rank1").write_bytes(b"not a session")
    done = launched(2, "-m", "ds4_mlx.tools.pipeline_check", str(models["tiny"]), str(tmp_path / "x"), "--load",
                    str(path))
    # (mlx.launch exits 0 whatever its ranks do: what they say is the test)
    assert "another rank's part" in done.stderr and "exited with code 1" in done.stderr
    assert "Traceback" not in done.stderr


def test_the_disk_store_on_two_ranks_restores_exactly_and_refuses_a_damaged_part(models, tmp_path):
    """The disk store across 2 ranks (each rank's layers in its own file): a prompt stored by one run comes
    back in the next (a restart) with one process's logits; a rank's damaged file makes every rank refuse
    the entry, and the prompt is computed again, with the same logits."""
    model, _ = load(models["tiny"])
    ids = check.prompt_ids(model.args.vocab_size)
    alone = tmp_path / "alone"
    cold, warm = (check.through_the_disk(Session(model, **check.SESSION_OPTIONS), ids, alone) for _ in range(2))
    assert cold["from_disk"] == 0 and warm["from_disk"] > 0
    disk = tmp_path / "kv"

    def run(name):
        return launched_script(2, models["tiny"], tmp_path / name, "--disk", str(disk))

    assert_same(run("cold"), cold)
    (part,) = (disk / "rank1").glob("*.kv.safetensors")
    assert [p.name for p in disk.glob("*.kv.safetensors")] == [part.name]
    assert_same(run("warm"), warm)
    damaged = bytearray(part.read_bytes())
    damaged[len(damaged) // 2] ^= 0xFF
    part.write_bytes(bytes(damaged))
    done = launched(2, "-m", "ds4_mlx.tools.pipeline_check", str(models["tiny"]), str(tmp_path / "damaged"),
                    "--disk", str(disk))
    assert "unusable" in done.stderr and "checksum mismatch" in done.stderr and "Traceback" not in done.stderr
    assert_same(dict(np.load(tmp_path / "damaged" / "logits.npz")), cold)


def test_generate_prints_what_one_process_prints(demo, capsys, tmp_path):
    """With a DSpark drafter (`--mtp FILE --dspark`), which drafts on rank 0: its rounds run the pipeline's
    plain steps and its verifies (the logits tests check the plain path alone)."""
    from ds4_mlx import cli

    dspark = random_dspark(demo[0].args, seed=3)
    path = write_gguf(tmp_path / "dspark.gguf", dspark_metadata(dspark.dspark), dspark_tensors(dspark),
                      arch="deepseek4-dspark")
    command = ["generate", "-p", "Hello there", "-n", "12", "--nothink", "--temp", "0", "--mtp", str(path), "--dspark"]
    assert cli.main(command) == 0
    alone = capsys.readouterr().out
    assert alone.strip()
    done = launch(2, "-m", "ds4_mlx.cli", *command)
    assert done.stdout == alone  # rank 0 prints; rank 1 says nothing
    assert re.search(r"\[speculation: \d+ verifies, [1-9]\d* drafted", done.stderr), done.stderr


def start_ranks(ranks, folder, *command):
    """The processes mlx.launch would start (the ring's host file, MLX_RANK), each with its own pipes: under
    mlx.launch a rank's exit makes it stop the others at once, and drop what they print after that."""
    port = free_ports(ranks)
    hostfile = folder / "hosts.json"
    hostfile.write_text(json.dumps([[f"127.0.0.1:{port + r}"] for r in range(ranks)]))
    return [subprocess.Popen([sys.executable, *command], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             env={**os.environ, "PYTHONPATH": str(REPO), "MLX_HOSTFILE": str(hostfile),
                                  "MLX_RANK": str(r)})
            for r in range(ranks)]


def started_slow_request(models, tmp_path):
    """Two ranks of a slow request, once rank 0 says it has started decoding."""
    ranks = start_ranks(2, tmp_path, "-m", "ds4_mlx.tools.pipeline_check", str(models["tiny"]), str(tmp_path),
                        "--slow")
    deadline = time.monotonic() + 60
    while not (tmp_path / "started").exists() and ranks[0].poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    return ranks


def test_a_rank_killed_mid_request_stops_rank_0_with_an_error(models, tmp_path):
    ranks = started_slow_request(models, tmp_path)
    try:
        assert (tmp_path / "started").exists(), ranks[0].communicate(timeout=10)
        ranks[1].kill()  # mid-request: rank 0 is decoding
        out, err = ranks[0].communicate(timeout=30)  # no hang
    finally:
        for process in ranks:
            if process.poll() is None:
                process.kill()
    assert ranks[0].returncode == 1
    assert "lost another rank of the pipeline" in err and "Traceback" not in err


def test_a_rank_that_stops_answering_is_given_up(models, tmp_path, monkeypatch):
    monkeypatch.setenv("DS4_MLX_RANK_TIMEOUT", "3")
    ranks = started_slow_request(models, tmp_path)
    try:
        assert (tmp_path / "started").exists(), ranks[0].communicate(timeout=10)
        ranks[1].send_signal(signal.SIGSTOP)  # alive, its connections open, silent
        out, err = ranks[0].communicate(timeout=30)  # no hang
    finally:
        for process in ranks:
            if process.poll() is None:
                process.kill()
    assert ranks[0].returncode == 3 and "no answer from the other ranks for 3 s" in err


# Without launching -------------------------------------------------------------------------------------


def test_layer_plan_is_contiguous_and_balanced_by_bytes():
    sizes = {f"layers.{i}.w": b for i, b in enumerate([5, 1, 1, 1, 9, 2, 2, 3])}
    sizes.update({"embed.weight": 4, "lm_head.weight": 6})
    plans = {}
    for ranks, extra in itertools.product((1, 2, 3, 4), (0, 7)):  # extra: rank 0's drafter and copy of the head
        ranges = plans[ranks, extra] = plan_layers(sizes, 8, ranks, extra)
        assert [r.start for r in ranges] == [0] + [r.stop for r in ranges[:-1]] and ranges[-1].stop == 8
        loads = [sum(sizes[f"layers.{i}.w"] for i in r) for r in ranges]
        loads[0] += 4 + extra
        loads[-1] += 6
        # no other contiguous split has a smaller largest load (all of them, enumerated)
        best = min(max(sum(sizes[f"layers.{i}.w"] for i in range(a, b)) + (4 + extra if a == 0 else 0)
                       + (6 if b == 8 else 0) for a, b in zip((0,) + cuts, cuts + (8,)))
                   for cuts in itertools.combinations(range(1, 8), ranks - 1))
        assert max(loads) == best
    assert plans[2, 7] != plans[2, 0]
    with pytest.raises(ValueError, match="at most one rank a layer"):
        plan_layers(sizes, 8, 9)


def test_held_names():
    assert held_name("layers.5.attn.q_a.weight", range(4, 8), 8) == "layers.1.attn.q_a.weight"
    assert held_name("layers.3.attn.q_a.weight", range(4, 8), 8) is None
    assert held_name("embed.weight", range(0, 4), 8) == "embed.weight" and held_name("embed", range(4, 8), 8) is None
    assert held_name("lm_head.scales", range(4, 8), 8) == "lm_head.scales" and held_name("norm.weight", range(0, 4), 8) is None


def test_stages_in_one_process_chain_to_the_whole_model(models):
    """Two models of a layer range each, run one after the other, give the whole model's logits: each holds
    exactly its own weights."""
    path = models["pro"]
    whole, _ = load(path)
    first, _ = load(path, layers=range(0, 3))
    second, _ = load(path, layers=range(3, whole.args.num_hidden_layers))
    assert not hasattr(first, "lm_head") and not hasattr(second, "embed") and len(first.layers) == 3
    ids = mx.array([check.prompt_ids(whole.args.vocab_size, 30)], dtype=mx.int32)
    flat = ids.reshape(-1)
    streams = first._streams(flat)
    for part in (first, second):
        for layer, cache in zip(part.layers, part.make_cache()):
            view = cache.view(ids.shape[1])
            streams, _ = layer(streams, flat, view[0].positions, [view], part.quant_sim)
    assert mx.array_equal(second._logits(streams), whole(ids)[0]).item()


def test_a_saved_part_of_another_split_is_refused(models, tmp_path):
    """A rank's file names the layers it holds: a rank of another split (its layers as many and of the same
    kinds, its model otherwise the same) refuses it instead of reading other layers' caches as its own."""
    from ds4_mlx.cache.state import StateFileError

    path = tmp_path / "part.safetensors"
    Session(load(models["pro"], layers=range(3, 5))[0]).save(path)
    other = load(models["pro"], layers=range(5, 7))[0]
    assert other.args.compress_ratios[3:5] == other.args.compress_ratios[5:7]
    with pytest.raises(StateFileError, match="holds the caches of layers 3 to 4, this process holds layers 5 to 6"):
        Session(other).load(path)
    Session(load(models["pro"], layers=range(3, 5))[0]).load(path)  # its own split's


def test_a_rank_takes_the_whole_models_lanes(models):
    """A rank whose layers are window-only (no lanes of their own) takes its lanes where the whole model's
    session does, on the chunk grid: every rank agrees on the same checkpoints."""
    from types import SimpleNamespace

    from ds4_mlx.distributed import RankSession, Stage

    whole, _ = load(models["tiny"])
    part, _ = load(models["tiny"], layers=range(0, 2))
    assert set(part.args.compress_ratios[:2]) == {0}
    stage = Stage(part, SimpleNamespace(rank=0, size=2), [range(0, 2), range(2, whole.args.num_hidden_layers)])
    expected = Session(whole, **check.SESSION_OPTIONS).lane_every
    assert expected % check.SESSION_OPTIONS["max_chunk"] == 0
    assert RankSession(stage, **check.SESSION_OPTIONS).lane_every == expected


def test_bench_distributed_compares_two_ranks_with_one(capsys, demo):
    import json

    from ds4_mlx import cli
    from ds4_mlx.models.variants import flash_args, pro_args

    assert cli.main(["bench", "distributed", "--json", "--prompt", "24", "--decode", "3"]) == 0
    figures = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert figures["max_logit_diff"] <= TOLERANCE and figures["prefill_tok_s_2"] > 0 and figures["decode_ms_2"] > 0
    rows = {(r["model"], r["ranks"]): r for r in figures["real_widths"]}
    # two ranks pass 4 streams of hidden float32 one way and a row of vocab float32 logits back, per token
    for name, args in (("flash", flash_args()), ("pro", pro_args())):
        assert rows[name, 2]["decode_kib"] * 1024 == 4 * args.hidden_size * 4 + args.vocab_size * 4
        assert rows[name, 4]["prefill_kib_per_token"] * 1024 == 3 * 4 * args.hidden_size * 4
        # a drafter on rank 0 reads the streams of one layer (MTP) or three (DSpark) per verified row
        assert rows[name, 2]["mtp_drafter_kib_per_row"] * 1024 == 4 * args.hidden_size * 4
        assert rows[name, 4]["dspark_drafter_kib_per_row"] * 1024 == 3 * 4 * args.hidden_size * 4
    # Thunderbolt 5 moves them 8 times faster than 10 GbE
    assert rows["pro", 2]["decode_us_10gbe"] == pytest.approx(8 * rows["pro", 2]["decode_us_thunderbolt5"])


def test_a_stage_reads_only_its_own_tensors(models, monkeypatch):
    from ds4_mlx.convert import gguf

    read = []
    chunks = gguf.tensor_chunks
    monkeypatch.setattr(gguf, "tensor_chunks", lambda f, plan, log=None: (read.append(plan.name), chunks(f, plan, log))[1])
    model, _ = load(models["pro"], layers=range(3, 5))
    assert read and all(re.match(r"blk\.[34]\.", name) for name in read)
    assert len(model.layers) == 2 and not hasattr(model, "embed") and not hasattr(model, "lm_head")


def test_speculative_decoding_drafts_as_one_process(models, tmp_path):
    """The drafter runs on rank 0 (with a copy of the LM head) and reads streams that the other ranks make:
    here DSpark's taps of a layer on each of 3 ranks, MTP's of the last layer. Greedy decoding with each
    gives one process's tokens, drafts, the logits each draft was chosen from and the tokens each verify
    committed: through a first chunk longer than the drafter's log keeps, rounds, and a rewind."""
    model, _ = load(models["tiny"])

    def dspark_file(taps):
        dspark = random_dspark(model.args, seed=3, target_layer_ids=taps)
        return write_gguf(tmp_path / "dspark.gguf", dspark_metadata(dspark.dspark), dspark_tensors(dspark),
                          arch="deepseek4-dspark")

    mtp = write_gguf(tmp_path / "mtp.gguf", {}, mtp_tensors(random_mtp(model.args, seed=4)))
    plan = plan_model(models["tiny"], 3, [dspark_file([0, 1, 2]), mtp])  # (rank 0 holds the drafters: their sizes)
    drafters = [dspark_file([r.stop - 1 for r in plan]), mtp]  # DSpark reads the last layer of each rank
    assert plan_model(models["tiny"], 3, drafters) == plan
    ids = check.prompt_ids(model.args.vocab_size)
    expected = {}
    for drafter in drafters:
        expected.update(check.speculated(Session(model, **check.SPECULATION_OPTIONS), ids, drafter))
    assert len(expected["dspark.drafts"]) == len(expected["mtp.drafts"]) == 20 * check.DRAFTS  # a round a token
    assert_same(launched_script(3, models["tiny"], tmp_path / "out", "--mtp", *map(str, drafters)), expected)


def test_the_server_on_two_ranks_answers_as_one_process_restarts_from_disk_and_stops_when_a_rank_dies(demo, tmp_path):
    """`serve` on 2 ranks answers as one process: a prompt, its resend (an exact rewind), another
    conversation, a long one. With `--kv-disk-dir`, each rank saves its own layers' caches at shutdown
    (rank 1 in its own subfolder); restarted, rank 0 finds the long conversation on disk, both ranks load
    their part, and the answer is still one process's. Then rank 1 is killed in the middle of a request:
    the request gets an error and rank 0 stops at once, saying why in one line."""
    pytest.importorskip("openai")
    from openai import OpenAI

    from ds4_mlx.tools.testing import DEMO_MODEL_ID, answer_text, long_conversation, served, wait_healthy

    asks = [[{"role": "user", "content": "Hello there"}]] * 2 + [[{"role": "user", "content": "Tell me more"}],
                                                                 long_conversation(words=300)]

    def answers(client, asks):
        return [answer_text(client.chat.completions.create(model=DEMO_MODEL_ID, messages=m, max_tokens=10,
                                                           temperature=0)) for m in asks]

    def serving():
        port = free_ports(1)
        ranks = start_ranks(2, tmp_path, "-m", "ds4_mlx.cli", "serve", "--port", str(port), "--ctx", "8192",
                            "--sessions", "2", "--model-id", DEMO_MODEL_ID, "--kv-disk-dir", str(disk))
        wait_healthy(f"http://127.0.0.1:{port}", ranks[0])
        return ranks, OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="-", max_retries=0)

    with served(ctx=8192, sessions=2) as (_, client):
        expected = answers(client, asks)
    disk = tmp_path / "kv"
    ranks = []
    try:
        ranks, client = serving()
        assert answers(client, asks) == expected
        for process in ranks:
            process.send_signal(signal.SIGTERM)  # as Ctrl+C does: rank 1 follows until rank 0 has saved
        outputs = [process.communicate(timeout=60) for process in ranks]
        assert [process.returncode for process in ranks] == [0, 0], outputs
        assert "reason=shutdown" in outputs[0][1]
        stored = sorted(p.name for p in disk.glob("*.kv.safetensors"))
        assert stored and stored == sorted(p.name for p in (disk / "rank1").glob("*.kv.safetensors"))

        ranks, client = serving()
        assert answers(client, asks[-1:]) == expected[-1:]
        stream = client.chat.completions.create(model=DEMO_MODEL_ID, messages=asks[0], max_tokens=5000,
                                                temperature=0, stream=True)
        next(iter(stream))  # decoding
        ranks[1].kill()
        with pytest.raises(Exception, match="worker failed"):
            list(stream)
        _, log = ranks[0].communicate(timeout=30)  # no hang
    finally:
        for process in ranks:
            if process.poll() is None:
                process.kill()
    assert "kv disk: hit" in log and "disk hit: slot 0 starts from a stored session" in log, log
    assert ranks[0].returncode == 1 and "Traceback" not in log
    assert re.search(r"the worker thread stopped: rank 0 lost another rank of the pipeline while .*\n.*exiting with "
                     "status 1", log), log
