"""benchmarks/codec_table.py without training: the rows' plan (matched bytes, long rows, unknown codecs), what a
rerun on the same results file still runs, each run's command line and the table (no runs)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))  # as `python benchmarks/x.py` has it
import codec_table  # noqa: E402
from codec_table import ROWS, Planned, Row, done, plan, table, to_run  # noqa: E402

KNOWN = {"q4": 1000, "q2": 500, "fp32": 8000}  # a delta's bytes, made up (int8 and fp8: not known here)


def sizes(codec: str, settings: dict) -> int | None:
    if codec == "sparse":
        return 20 + int(4000 * settings.get("density", 64 / 4096))
    return KNOWN.get(codec)


def planned(steps: int = 1000, seeds: int = 3, budget: float = 0.5, rows=ROWS) -> dict[str, Planned]:
    return {p.row.name: p for p in plan(rows, steps=steps, seeds=seeds, long_seeds=1, budget=budget,
                                        message_bytes=sizes)}


def test_matched_rows_come_nearest_the_budget_by_their_knob() -> None:
    """Budget: 0.5 x the q4 row's 50 rounds x 1000 bytes = 25,000 bytes a host."""
    rows = planned()
    assert (rows["q4"].local_steps, rows["q4"].rounds, rows["q4"].planned_bytes) == (20, 50, 50_000)
    assert (rows["q4_matched"].local_steps, rows["q4_matched"].planned_bytes) == (40, 25_000)
    assert rows["fp32_matched"].rounds == 3 and rows["fp32_matched"].planned_bytes == 24_000
    sparse = rows["sparse_matched"]
    assert sparse.local_steps == 20 and sparse.settings["density"] * 4096 == round(sparse.settings["density"] * 4096)
    assert abs(sparse.planned_bytes - 25_000) <= 50 * 4000 / 4096  # within one entry a chunk of the budget
    assert rows["q2_b256_matched"].same_as == "q2_b256"  # already at the budget: no run of its own
    assert rows["sparse"].settings == {} and rows["sparse"].planned_bytes == 50 * (20 + 62)


def test_rows_of_an_unknown_codec_are_skipped_saying_why() -> None:
    rows = planned()
    for name in ("int8", "int8_matched", "int8_no_ef", "fp8", "fp8_matched", "fp8_no_ef"):
        assert rows[name].skipped == f"codec '{name.split('_')[0]}' is not in this lightning_nodeox"
    lines = table(list(rows.values()), 1000, [], 3)
    assert any(line.startswith("| int8 |") and "skipped: codec 'int8' is not in this lightning_nodeox" in line
               for line in lines)
    assert all(p.row.codec not in ("int8", "fp8") for p, _ in to_run(list(rows.values()), 1000, []))


def test_a_long_row_runs_fewer_seeds_and_the_table_says_so() -> None:
    rows = planned(rows=(*ROWS, Row("q4_h2", "q4", local_steps=2)))
    assert rows["q4_h2"].rounds == 500 and rows["q4_h2"].seeds == (0,) and rows["q4"].seeds == (0, 1, 2)
    line = next(line for line in table(list(rows.values()), 1000, [], 3) if line.startswith("| q4_h2 |"))
    assert "0 of 1 (long row)" in line


def result(loss: float, sent: float = 1e6) -> dict:
    return {"val_loss": loss, "bytes_per_host": sent, "wall_s": 300.0, "hosts_identical": True, "curve": []}


def test_a_rerun_runs_only_what_the_results_file_lacks_under_the_same_plan(tmp_path) -> None:
    rows = planned()
    q4, sparse = rows["q4"], rows["sparse"]
    path = tmp_path / "results.jsonl"
    lines = [{"row": "q4", "seed": 0, "plan": q4.key(1000), "result": result(2.5)},
             {"row": "q4", "seed": 1, "plan": q4.key(500), "result": result(2.7)},  # another length: not this plan
             {"row": "q4", "seed": 2, "plan": q4.key(1000), "failed": "RuntimeError: ..."},  # runs again
             {"row": "sparse", "seed": 0, "plan": sparse.key(1000), "result": result(2.6, 5e4)}]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    read = codec_table.read_results(path)
    assert set(done(q4, 1000, read)) == {0} and set(done(sparse, 1000, read)) == {0}
    pending = [(p.row.name, seed) for p, seed in to_run(list(rows.values()), 1000, read)]
    assert ("q4", 0) not in pending and ("q4", 1) in pending and ("q4", 2) in pending
    assert ("sparse", 0) not in pending and ("q2_b256_matched", 0) not in pending  # the same run as q2_b256's
    assert len(pending) == 3 * sum(1 for p in rows.values() if not p.skipped and not p.same_as) - 2
    assert codec_table.read_results(tmp_path / "none.jsonl") == []


def test_the_table_gives_each_rows_mean_spread_bytes_and_wall_time() -> None:
    rows = planned()
    q4, sparse = rows["q4"], rows["sparse"]
    lines = [{"row": "q4", "seed": s, "plan": q4.key(1000), "result": result(v, 2e6)}
             for s, v in enumerate((2.50, 2.54, 2.52))]
    lines += [{"row": "sparse", "seed": 0, "plan": sparse.key(1000), "result": result(2.61, 1e5)}]
    text = table(list(rows.values()), 1000, lines, 3)
    q4_line = next(line for line in text if line.startswith("| q4 |"))
    assert "| 3 of 3 | 2.5200 (2.5000–2.5400) | 0.0200 | 2.00 MB | 1.000x | 300 |" in q4_line
    sparse_line = next(line for line in text if line.startswith("| sparse |"))
    assert "| 1 of 3 | 2.6100 (2.6100–2.6100) | - | 100.0 kB | 0.050x |" in sparse_line
    assert next(line for line in text if line.startswith("| ddp |")).endswith("| 0 of 3 | not run yet | | | | |")


def test_each_row_runs_as_a_convergence_mode_of_its_own(tmp_path) -> None:
    rows = planned()
    cmd = codec_table.convergence_command(rows["sparse_no_ef"], 2, 1000, tmp_path / "r.jsonl")
    mode = json.loads(cmd[cmd.index("--define-mode") + 1])
    assert mode == {"name": "sparse_no_ef", "coordinator": ["--codec", "sparse"],
                    "strategy": {"error_feedback": False}, "local_steps": 20}
    assert cmd[cmd.index("--first-seed") + 1] == "2" and cmd[cmd.index("--eval-every") + 1] == "20"
    assert "--without-ddp" in cmd and cmd[cmd.index("--modes") + 1] == "sparse_no_ef"
    matched = codec_table.convergence_command(rows["sparse_matched"], 0, 1000, tmp_path / "r.jsonl")
    flags = json.loads(matched[matched.index("--define-mode") + 1])["coordinator"]
    assert flags[:3] == ["--codec", "sparse", "--density"] and float(flags[3]) == rows["sparse_matched"].settings[
        "density"]
    diloco_cmd = codec_table.convergence_command(rows["fp32_diloco"], 0, 1000, tmp_path)
    diloco = json.loads(diloco_cmd[diloco_cmd.index("--define-mode") + 1])
    assert diloco["coordinator"] == ["--codec", "fp32", *codec_table.DILOCO]
    ddp = codec_table.convergence_command(rows["ddp"], 0, 1000, tmp_path)
    assert ddp[-2:] == ["--modes", "ddp"] and "--define-mode" not in ddp


def test_the_real_byte_counts_are_the_delta_messages_on_the_language_model() -> None:
    size = codec_table.lm_message_bytes()
    assert size("no-such-codec", {}) is None
    q4, q2 = size("q4", {}), size("q2", {"block_size": 256})
    assert 0.45 < q2 / q4 < 0.52 and size("sparse", {}) < 0.07 * q4


def test_the_outer_sweep_rows_differ_from_the_fp32_row_in_the_outer_step_alone(tmp_path) -> None:
    rows = planned()
    sweep = [p for name, p in rows.items() if name.startswith("fp32_nesterov_")]
    assert [p.row.outer for p in sweep] == [codec_table.nesterov(lr, mu) for lr, mu in codec_table.OUTER_SWEEP]
    for p in sweep:
        assert (p.row.codec, p.local_steps, p.settings, p.seeds) == ("fp32", 20, {}, (0, 1, 2))
        cmd = codec_table.convergence_command(p, 0, 1000, tmp_path)
        mode = json.loads(cmd[cmd.index("--define-mode") + 1])
        assert mode["coordinator"] == ["--codec", "fp32", *p.row.outer]
    assert codec_table.DILOCO == ("--outer-optimizer", "nesterov", "--outer-lr", "0.7", "--outer-momentum", "0.9")


def test_the_ingredient_rows_are_the_recipe_with_one_ingredient_back_as_the_earlier_form_had_it(tmp_path) -> None:
    """Each ``sparse_<knob>_<value>`` row is SparseLoCo's recipe as written (``sparse_tiles``: its 64x64 chunks) with
    one of the sparse codec's settings at the earlier form's value (as convergence.py's ``sparse_d1`` has them all),
    run with that one flag more; the chunking's is the ``sparse`` row, ``--codec sparse`` alone (runs of 4096)."""
    from convergence_modes import SPARSE_EARLIER as EARLIER_FLAGS
    from lightning_nodeox.core.codecs.settings import settings_for

    rows = planned()
    written = rows["sparse_tiles"]
    assert written.settings == codec_table.SPARSELOCO == {"chunking": "tiles"} and rows["sparse"].settings == {}
    assert EARLIER_FLAGS[EARLIER_FLAGS.index("--chunking") + 1] == settings_for("sparse").chunking == "runs"
    ingredients = {n: p for n, p in rows.items() if n.startswith("sparse_") and p.row.codec == "sparse"
                   and not p.row.matched and p.row.error_feedback and n != "sparse_tiles"}
    assert set(ingredients) == {"sparse_mean_deltas", "sparse_error_decay_1", "sparse_levels_q2"}
    recipe = settings_for("sparse", **codec_table.SPARSELOCO)
    for name, p in ingredients.items():
        (knob, value), = ((k, v) for k, v in p.settings.items() if k not in codec_table.SPARSELOCO)
        assert p.settings == {**codec_table.SPARSELOCO, knob: value}
        assert getattr(recipe, knob) != value  # the recipe's own value differs
        flag = f"--{knob.replace('_', '-')}"
        assert EARLIER_FLAGS[EARLIER_FLAGS.index(flag) + 1] == str(value).removesuffix(".0")
        cmd = codec_table.convergence_command(p, 0, 1000, tmp_path)
        mode = json.loads(cmd[cmd.index("--define-mode") + 1])
        assert mode["coordinator"] == ["--codec", "sparse", "--chunking", "tiles", flag, str(value)]
        assert (p.local_steps, p.seeds) == (written.local_steps, written.seeds)


def test_the_curves_are_the_seeds_mean_at_the_steps_every_seed_evaluated() -> None:
    import codec_curves

    results = {0: {"curve": [[20, {"val_loss": 3.0}], [40, {"val_loss": 2.0}], [60, {"val_loss": 1.0}]]},
               1: {"curve": [[20, {"val_loss": 2.0}], [40, {"val_loss": 1.0}]]}}
    assert codec_curves.mean_curve(results) == [(20, 2.5), (40, 1.5)]
    assert codec_curves.mean_curve({}) == []
