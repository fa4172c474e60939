"""The prompt cache's disk tier (``prompt_store``): a request resumed from disk gives the tokens and
log-probs, bit for bit, of the same request resumed from RAM and prefilled cold (the oracle: the
request alone through the RAM tier and through no cache); the files are written atomically, and a
killed writer, flipped bytes, another draft, a full budget or an unwritable directory never cost a
request."""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import mlx.core as mx
import pytest

from dflash_mlx import stream_generate, tiny
from dflash_mlx.api import load
from dflash_mlx.prompt_cache import PromptCachePool
from dflash_mlx.prompt_store import SUFFIX, TEMP_PREFIX, PromptStore, file_crc, is_entry_name
from tests.test_prompt_cache import ids

GB = 1 << 30


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    target_dir, draft_dir = tiny.write_pair(tmp_path_factory.mktemp("ps"))
    return load(str(target_dir), draft=str(draft_dir))


def store_for(model, directory, budget=GB, **kwargs) -> PromptStore:
    store = PromptStore.for_model(model, directory, budget, **kwargs)
    store.wait_scanned()
    return store


def generate(model, tokenizer, prompt, pool=None, flush=True, **kwargs):
    """The request's responses; with a disk tier, once its entry (if any) is written (``flush``)."""
    out = list(stream_generate(model, tokenizer, prompt, prompt_cache=pool, max_tokens=kwargs.pop("max_tokens", 12),
                               block_tokens=kwargs.pop("block_tokens", 4), **kwargs))
    if flush and pool is not None and pool.store is not None:
        assert pool.store.flush(timeout=60)
    return out


def bits(responses):
    return [r.token for r in responses], [r.logprobs for r in responses]


def same(a, b) -> bool:
    (ta, la), (tb, lb) = bits(a), bits(b)
    return ta == tb and len(la) == len(lb) and all(mx.array_equal(x, y).item() for x, y in zip(la, lb))


def entries(directory: Path):
    return sorted(p for p in directory.iterdir() if is_entry_name(p.name))


@pytest.mark.parametrize("use_draft", [True, False], ids=["speculative", "target-only"])
def test_a_request_resumed_from_disk_is_the_request_from_ram_and_cold(pair, tmp_path, use_draft):
    """The next turn of a conversation, after a restart (a new pool and store on the directory the
    first wrote): it resumes at the first turn's last grid checkpoint (320 of 330), from disk, and
    its tokens and log-probs are those of the same turn resumed from RAM and prefilled cold."""
    model, tokenizer = pair
    turn1 = ids(1, 330)
    first = PromptCachePool(GB, store=store_for(model, tmp_path))
    out1, _ = bits(generate(model, tokenizer, turn1, first, use_draft=use_draft))
    assert len(entries(tmp_path)) == 1 and first.store.stats.writes == 1
    turn2 = turn1 + out1 + ids(2, 9)

    restarted = PromptCachePool(GB, store=store_for(model, tmp_path))
    disk = generate(model, tokenizer, turn2, restarted, use_draft=use_draft)
    in_ram = PromptCachePool(GB)  # RAM only: the first turn, then the second
    assert bits(generate(model, tokenizer, turn1, in_ram, use_draft=use_draft))[0] == out1
    ram = generate(model, tokenizer, turn2, in_ram, use_draft=use_draft)
    cold = generate(model, tokenizer, turn2, None, use_draft=use_draft)
    assert restarted.store.stats.hits == 1 and in_ram.ram_hits == 1
    assert disk[-1].cached_prompt_tokens == ram[-1].cached_prompt_tokens == 320
    assert same(disk, ram) and same(disk, cold)


def test_a_longer_entry_on_disk_wins_over_a_shorter_history_in_ram(pair, tmp_path):
    """RAM holds a short history of the prompt's head; disk the whole previous prompt: the disk
    entry restarts further, so it is loaded (and the answer is the cold one)."""
    model, tokenizer = pair
    head = ids(3, 200)
    writer = PromptCachePool(GB, store=store_for(model, tmp_path))
    generate(model, tokenizer, head + ids(4, 150), writer, max_tokens=2)
    pool = PromptCachePool(GB)
    generate(model, tokenizer, head[:130], pool, max_tokens=2)  # RAM: restarts at 128 at most
    pool.store = store_for(model, tmp_path)
    prompt = head + ids(4, 150) + ids(5, 20)
    warm = generate(model, tokenizer, prompt, pool)
    assert pool.store.stats.hits == 1 and warm[-1].cached_prompt_tokens == 320
    assert same(warm, generate(model, tokenizer, prompt, None))


def test_flipped_bytes_and_a_truncated_file_are_skipped_removed_and_warned_about_once(pair, tmp_path, caplog):
    model, tokenizer = pair
    prompt = ids(6, 140)
    generate(model, tokenizer, prompt, PromptCachePool(GB, store=store_for(model, tmp_path)), max_tokens=2)
    (path,) = entries(tmp_path)
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF  # inside the arrays: the header still parses
    path.write_bytes(bytes(data))
    caplog.set_level(logging.WARNING, logger="dflash_mlx.prompt_store")
    pool = PromptCachePool(GB, store=store_for(model, tmp_path))
    resend = generate(model, tokenizer, prompt + [7], pool, max_tokens=4)
    assert resend[-1].cached_prompt_tokens == 0 and pool.store.stats.hits == 0 and pool.store.stats.bad_files == 1
    assert [r.message for r in caplog.records].count(next(r.message for r in caplog.records if "checksum" in r.message)) == 1
    assert path not in entries(tmp_path)
    assert same(resend, generate(model, tokenizer, prompt + [7], None, max_tokens=4))

    (path,) = entries(tmp_path)  # the resend's own entry, written at its release
    path.write_bytes(path.read_bytes()[:-100])  # a truncated file: found at the scan, before any load
    caplog.clear()
    store = store_for(model, tmp_path)
    assert store.find(prompt + [7]) is None and entries(tmp_path) == [] and store.stats.bad_files == 1
    assert len([r for r in caplog.records if "removing" in r.message]) == 1


def test_another_draft_does_not_load_the_entry_and_leaves_it(pair, tmp_path):
    """A changed draft (its weights file rewritten: another mtime) has another fingerprint: the
    entry is not loaded, and stays (another server on the directory may use it)."""
    model, tokenizer = pair
    prompt = ids(7, 140)
    generate(model, tokenizer, prompt, PromptCachePool(GB, store=store_for(model, tmp_path)), max_tokens=2)
    before = entries(tmp_path)
    other_draft = tmp_path.parent / f"{tmp_path.name}-draft"
    shutil.copytree(model.draft_path, other_draft)
    weights = next(other_draft.glob("*.safetensors"))
    os.utime(weights, ns=(time.time_ns(), time.time_ns() + 10**9))
    other, _ = load(str(model.target_path), draft=str(other_draft))
    store = store_for(other, tmp_path)
    assert store.fingerprint != store_for(model, tmp_path).fingerprint
    pool = PromptCachePool(GB, store=store)
    assert generate(other, tokenizer, prompt, pool, max_tokens=2)[-1].cached_prompt_tokens == 0
    assert store.stats.hits == 0 and set(before) <= set(entries(tmp_path))


def test_the_directory_stays_within_its_budget_least_recently_used_out(pair, tmp_path):
    model, tokenizer = pair
    store = store_for(model, tmp_path)
    pool = PromptCachePool(0, store=store)  # RAM keeps only the latest history
    prompts = [ids(10 + i, 140) for i in range(3)]
    generate(model, tokenizer, prompts[0], pool, max_tokens=2)
    one = store.nbytes
    store.budget_bytes = int(2.5 * one)
    generate(model, tokenizer, prompts[1], pool, max_tokens=2)
    time.sleep(0.01)
    assert store.load(store.find(prompts[0] + [1])[0], 8) is not None  # a load: prompts[0]'s entry used last
    generate(model, tokenizer, prompts[2], pool, max_tokens=2)  # a third entry: the least recently used goes
    assert store.nbytes <= store.budget_bytes and store.stats.evictions == 1 and len(entries(tmp_path)) == 2
    check = store_for(model, tmp_path)
    assert check.find(prompts[1] + [1]) is None and check.find(prompts[0] + [1])[1] == 128
    assert check.find(prompts[2] + [1])[1] == 128


def test_an_unwritable_directory_costs_a_warning_not_the_request(pair, tmp_path, caplog):
    model, tokenizer = pair
    directory = tmp_path / "cache"
    store = store_for(model, directory)
    directory.rmdir()
    directory.write_text("a file where the directory was")  # every write fails (as a full disk would)
    caplog.set_level(logging.WARNING, logger="dflash_mlx.prompt_store")
    pool = PromptCachePool(GB, store=store)
    prompt = ids(20, 140)
    answer = generate(model, tokenizer, prompt, pool)
    generate(model, tokenizer, ids(21, 140), pool, max_tokens=2)
    assert store.stats.write_errors == 2 and len([r for r in caplog.records if "could not write" in r.message]) == 1
    assert same(answer, generate(model, tokenizer, prompt, None))


WRITER = """
import sys, mlx.core as mx
from pathlib import Path
from dflash_mlx.prompt_store import write_entry
arrays = {f"a{i}": mx.random.normal((1024, 1024)) for i in range(96)}
mx.eval(arrays)
print("ready", flush=True)
sys.stdin.readline()
write_entry(Path(sys.argv[1]), "0123456789abcdef-0123456789abcdef", arrays, {"format": "1"})
print("done", flush=True)
"""


@pytest.mark.slow  # a subprocess writing 400 MB
def test_a_writer_killed_mid_write_leaves_nothing_that_is_loaded(pair, tmp_path):
    """A writer killed (SIGKILL) while it writes a 400 MB entry leaves a temp file, never a file
    under an entry's name: the scan indexes nothing, and the temp file goes once stale."""
    model, _ = pair
    killed_mid_write = False
    for attempt in range(3):
        directory = tmp_path / str(attempt)
        directory.mkdir()
        writer = subprocess.Popen([sys.executable, "-c", WRITER, str(directory)], stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, text=True)
        assert writer.stdout.readline().strip() == "ready"
        writer.stdin.write("\n")
        writer.stdin.flush()
        deadline = time.time() + 30
        while time.time() < deadline:
            temps = [p for p in directory.iterdir() if p.name.startswith(TEMP_PREFIX)]
            if temps and temps[0].stat().st_size > 1 << 20:
                break
        writer.send_signal(signal.SIGKILL)
        writer.wait()
        temps = [p for p in directory.iterdir() if p.name.startswith(TEMP_PREFIX)]
        if temps and not entries(directory):
            killed_mid_write = True
            assert temps[0].stat().st_size < 96 << 22  # it was cut short
            store = store_for(model, directory)
            assert store._entries == {} and store.stats.bad_files == 0
            old = time.time() - 3600
            os.utime(temps[0], (old, old))
            store.refresh()
            assert list(directory.iterdir()) == []  # the killed writer's temp file is gone
            break
    assert killed_mid_write


def test_two_stores_on_one_directory_write_whole_files(pair, tmp_path):
    """Two servers on one directory, writing the same history and others: every file left is a
    whole entry (its checksum holds), and each server loads the other's."""
    model, tokenizer = pair
    a, b = PromptCachePool(GB, store=store_for(model, tmp_path)), PromptCachePool(GB, store=store_for(model, tmp_path))
    shared = ids(30, 140)
    generate(model, tokenizer, shared, a, max_tokens=2)
    generate(model, tokenizer, shared, b, max_tokens=2)  # b found a's entry on disk: nothing new written
    assert b.store.stats.hits == 1 and b.store.stats.writes == 0
    generate(model, tokenizer, ids(31, 140), b, max_tokens=2)
    for path in entries(tmp_path):
        assert file_crc(path) == int(path.name[: -len(SUFFIX)].split("-")[2], 16)
    assert generate(model, tokenizer, ids(31, 140) + [1], a, max_tokens=2)[-1].cached_prompt_tokens == 128
    assert a.store.stats.hits == 1


def test_a_restarted_server_reports_the_prompt_from_disk_as_cached_on_all_three_apis(pair, tmp_path):
    """A request, then the same request to a new server (a restart: a new store on the directory):
    its usage counts every prompt token but the last as cached, in each API's own field, and
    /metrics counts the disk hit and the bytes it loaded."""
    from fastapi.testclient import TestClient

    from dflash_mlx.server import create_app

    model, tokenizer = pair
    text = " ".join(f"w{i % 37}" for i in range(300))
    apis = {
        "/v1/chat/completions": ({"messages": [{"role": "user", "content": text}], "max_tokens": 3},
                                 lambda u: (u["prompt_tokens"], u["prompt_tokens_details"]["cached_tokens"])),
        "/v1/messages": ({"messages": [{"role": "user", "content": text}], "max_tokens": 3},
                         lambda u: (u["input_tokens"] + u["cache_read_input_tokens"], u["cache_read_input_tokens"])),
        "/v1/responses": ({"input": text, "max_output_tokens": 3},
                          lambda u: (u["input_tokens"], u["input_tokens_details"]["cached_tokens"])),
    }
    for i, (path, (body, usage)) in enumerate(apis.items()):
        body = {"model": "tiny", "temperature": 0, **body}
        directory = tmp_path / str(i)
        store = store_for(model, directory)
        with TestClient(create_app(model, tokenizer, "tiny", prompt_store=store)) as client:
            first = client.post(path, json=body)
            assert first.status_code == 200 and usage(first.json()["usage"])[1] == 0
        assert store.flush(timeout=60)  # as the server's process does when it exits (the writer is no daemon)
        with TestClient(create_app(model, tokenizer, "tiny", prompt_store=store_for(model, directory))) as client:
            again = client.post(path, json=body)
            prompt, cached = usage(again.json()["usage"])
            assert prompt > 200 and cached == prompt - 1, (path, again.json()["usage"])
            metrics = client.get("/metrics").text
        assert 'dflash_prompt_cache_disk_hits_total{model="tiny"} 1\n' in metrics
        loaded = next(line for line in metrics.splitlines() if line.startswith("dflash_prompt_cache_disk_loaded_bytes_total"))
        assert int(loaded.split()[-1]) > 0


def test_the_flags_say_what_they_do_and_a_negative_budget_is_refused_before_loading(tmp_path):
    import typer
    from typer.testing import CliRunner

    from dflash_mlx.cli import app

    commands = typer.main.get_command(app).commands
    for command in ("serve", "chat", "doctor"):
        helps = {p.opts[0]: p.help for p in commands[command].params}
        assert "restarted" in helps["--prompt-cache-dir"] and "0 turns the disk tier off" in helps["--prompt-cache-disk-gb"]
    done = CliRunner().invoke(app, ["serve", "-m", str(tmp_path / "missing"), "--prompt-cache-disk-gb", "-1"])
    assert done.exit_code == 1 and "--prompt-cache-disk-gb must not be negative (got -1.0)" in done.output


def test_doctor_shows_the_directorys_size_and_budget_and_leaves_other_files_alone(pair, tmp_path):
    """doctor counts the entries (not a file of another name, which the store neither reads,
    counts nor removes) against the budget."""
    from dflash_mlx.doctor import Report, _check_prompt_cache

    model, tokenizer = pair
    store = store_for(model, tmp_path)
    generate(model, tokenizer, ids(40, 140), PromptCachePool(GB, store=store), max_tokens=2)
    (tmp_path / "notes.safetensors").write_bytes(b"not an entry")
    (entry,) = entries(tmp_path)
    report = Report()
    _check_prompt_cache(report, tmp_path, 2.0, 8192)
    (check,) = report.checks
    assert check.name == "prompt cache on disk" and f"{tmp_path}: 1 entries" in check.detail and "of 1.86 GiB" in check.detail
    store_for(model, tmp_path).trim()
    assert (tmp_path / "notes.safetensors").exists() and store.nbytes == entry.stat().st_size


def test_a_write_queued_while_the_next_request_runs_on_its_history_keeps_the_bits_of_both(pair, tmp_path):
    """The first turn's entry is still queued (writes paused) while a second request runs on the
    same history in RAM and rewrites its caches from position 192 on (it shares 200 tokens): the
    second request's bits are its cold ones, and the entry, once written, holds the first turn's
    (a third request resumed from it at 320 gives its cold bits too)."""
    from dflash_mlx.prompt_store import loaded_crc, read_header

    model, tokenizer = pair
    store = store_for(model, tmp_path)
    pool = PromptCachePool(GB, store=store)
    turn1 = ids(50, 330)
    other = turn1[:200] + ids(51, 120)
    with store.writer.paused():
        generate(model, tokenizer, turn1, pool, flush=False)
        assert [len(j.tokens) for j in store.writer.pending()] == [329] and entries(tmp_path) == []
        second = generate(model, tokenizer, other, pool, flush=False)
        assert second[-1].cached_prompt_tokens == 192 and len(pool.histories) == 1  # the same history, rewritten
        assert store.stats.writes == 0
    assert store.flush(timeout=60) and store.stats.writes == 2
    assert same(second, generate(model, tokenizer, other, None))
    resend = turn1 + [5]
    restarted = PromptCachePool(GB, store=store_for(model, tmp_path))
    from_disk = generate(model, tokenizer, resend, restarted)
    assert restarted.store.stats.hits == 1 and from_disk[-1].cached_prompt_tokens == 320
    assert same(from_disk, generate(model, tokenizer, resend, None))
    for path in entries(tmp_path):  # the load's CRC, from the arrays in memory, is the file's
        header, _, head = read_header(path)
        assert loaded_crc(head, header, mx.load(str(path))) == file_crc(path)


def test_a_newer_entry_of_the_same_history_replaces_its_queued_one(pair, tmp_path):
    """Two turns of one conversation released while writes wait: the second turn's entry (its
    tokens extend the first's) replaces the first's in the queue, and only it is written; a turn
    that grew less than a quarter past the entry queued is not written at all."""
    model, tokenizer = pair
    store = store_for(model, tmp_path)
    pool = PromptCachePool(GB, store=store)
    turn1 = ids(60, 140)
    with store.writer.paused():
        out1 = [r.token for r in generate(model, tokenizer, turn1, pool, flush=False)]
        turn2 = turn1 + out1 + ids(61, 200)
        out2 = [r.token for r in generate(model, tokenizer, turn2, pool, flush=False)]
        assert [len(j.tokens) for j in store.writer.pending()] == [len(turn2) - 1] and store.stats.superseded == 1
        generate(model, tokenizer, turn2 + out2 + ids(62, 20), pool, flush=False)  # 32 more tokens: under a quarter
        assert len(store.writer.pending()) == 1
    assert store.flush(timeout=60) and store.stats.writes == 1
    (path,) = entries(tmp_path)
    assert store_for(model, tmp_path).find(turn2 + [1])[1] == len(turn2) - 1 - (len(turn2) - 1) % 64


EXITING = """
import sys
from pathlib import Path
from dflash_mlx import stream_generate
from dflash_mlx.api import load
from dflash_mlx.prompt_cache import PromptCachePool
from dflash_mlx.prompt_store import PromptStore
model, tokenizer = load(sys.argv[1], draft=sys.argv[2])
prompt = [(7 * i + 3) % 500 + 1 for i in range(200)]
kept = PromptCachePool(1 << 30, store=PromptStore.for_model(model, sys.argv[3], 1 << 30))
dropped = PromptCachePool(1 << 30, store=PromptStore.for_model(model, sys.argv[4], 1 << 30))
with kept.store.writer.paused(), dropped.store.writer.paused():
    for pool in (kept, dropped):
        list(stream_generate(model, tokenizer, prompt, prompt_cache=pool, max_tokens=2))
    assert len(kept.store.writer.pending()) == len(dropped.store.writer.pending()) == 1
    dropped.store.close(flush=False)
print("queued", flush=True)
"""


@pytest.mark.slow  # subprocesses
def test_a_process_exiting_with_a_write_queued_writes_it_whole_or_drops_it(pair, tmp_path):
    """A process that ends with a write queued finishes it (the writer is no daemon): a whole entry,
    its CRC right, no temp file; one closed without a flush leaves the directory empty."""
    model, _ = pair
    kept, dropped = tmp_path / "kept", tmp_path / "dropped"
    done = subprocess.run([sys.executable, "-c", EXITING, str(model.target_path), str(model.draft_path),
                           str(kept), str(dropped)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "queued", done.stderr
    (path,) = entries(kept)
    assert [p.name for p in kept.iterdir()] == [path.name]
    assert file_crc(path) == int(path.name[: -len(SUFFIX)].split("-")[2], 16)
    assert store_for(model, kept).find([(7 * i + 3) % 500 + 1 for i in range(201)])[1] == 192
    assert list(dropped.iterdir()) == []


def test_the_head_two_sessions_share_is_resumed_whole_by_the_third_after_a_restart(pair, tmp_path):
    """Two sessions after the same 760-token head (an agent's system prompt and tools), then a
    restart and a third: the second resumes at an evenly spaced checkpoint (640: the first never
    left the head, and its checkpoints are 128 apart), pins the grid point where it left the first
    (704, ``PromptCache.diverged``), and the third, from disk, resumes there; its bits are its cold ones."""
    model, tokenizer = pair
    head = ids(70, 760)
    pool = PromptCachePool(GB, store=store_for(model, tmp_path))
    generate(model, tokenizer, head + ids(71, 40), pool, max_tokens=2)
    second = generate(model, tokenizer, head + ids(72, 40), pool, max_tokens=2)
    assert second[-1].cached_prompt_tokens == 640 and pool.histories[-1].heads == [704]
    restarted = PromptCachePool(GB, store=store_for(model, tmp_path))
    third_prompt = head + ids(73, 60)
    third = generate(model, tokenizer, third_prompt, restarted)
    assert restarted.store.stats.hits == 1 and third[-1].cached_prompt_tokens == 704
    assert same(third, generate(model, tokenizer, third_prompt, None))


def test_a_sliding_window_target_resumed_from_disk_is_the_request_from_ram_and_cold(tmp_path):
    """A gpt-oss target (sliding windows of 3 rows, sinks) through the disk tier: its windows' rows
    go to disk with the entry and come back, and the next turn after a restart is, bit for bit, the
    same turn resumed from RAM and prefilled cold."""
    from dflash_mlx import tiny
    from tests.test_families_window import make_window_target

    target_dir = make_window_target(tmp_path / "target", "gpt_oss")
    config = json.loads((target_dir / "config.json").read_text())
    tiny.write_draft(tmp_path / "draft", tiny.draft_config(config, block_size=8, target_layer_ids=[3, 1]), seed=3)
    model, tokenizer = load(str(target_dir), draft=str(tmp_path / "draft"))
    turn1 = ids(1, 200)
    first = PromptCachePool(GB, store=store_for(model, tmp_path / "store"))
    out1, _ = bits(generate(model, tokenizer, turn1, first))
    turn2 = turn1 + out1 + ids(2, 9)
    restarted = PromptCachePool(GB, store=store_for(model, tmp_path / "store"))
    disk = generate(model, tokenizer, turn2, restarted)
    in_ram = PromptCachePool(GB)
    generate(model, tokenizer, turn1, in_ram)
    ram = generate(model, tokenizer, turn2, in_ram)
    cold = generate(model, tokenizer, turn2, None)
    assert restarted.store.stats.hits == 1 and disk[-1].cached_prompt_tokens == ram[-1].cached_prompt_tokens == 192
    assert same(disk, ram) and same(disk, cold)
