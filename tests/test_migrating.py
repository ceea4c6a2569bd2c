"""Every row of docs/migrating.md holds: each flag row, parsed as `fdx serve`
parses it, builds the config its "builds" cell names (or is refused saying
fdx has no such setting, or changes nothing); each `LLM(...)` and
`SamplingParams` row's fdx side is accepted by fdx's class with the value
it shows, and each "none" row's vLLM/FastDeploy name is refused rather than
silently taken. The metric rows are checked against a running server in
tests/test_serve_names.py. Rows others add (parser flags, tracing metrics)
are read and run the same way."""
from __future__ import annotations

import ast
import pathlib
import shlex

import pytest
import yaml

from fdx.entrypoints.cli import build_parser, main
from fdx.core.config import DEPRECATED, DEPRECATED_FLAT, FLAT_KEYS, ConfigError, FdxConfig
from fdx.core.sampling_params import SamplingParams
from fdx.entrypoints.serving.cli import server_config

DOC = pathlib.Path(__file__).resolve().parent.parent / "docs" / "migrating.md"


def table(heading: str) -> list[list[str]]:
    """The rows (cells, backticks kept) of the first table under ``## heading``."""
    text = DOC.read_text()
    section = text.split(f"## {heading}\n", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("|")]
    cells = [[c.strip() for c in row.strip("|").split(" | ")] for row in rows[2:]]   # no header, no rule
    assert cells, heading
    return cells


def code(cell: str) -> str:
    """The first `...` span of a cell."""
    return cell.split("`", 2)[1]


PARSER = build_parser()


def serve_config(argv: list[str]) -> FdxConfig:
    return server_config(PARSER.parse_args(["serve", *argv]))


def attr(cfg: FdxConfig, key: str):
    key = DEPRECATED.get(DEPRECATED_FLAT.get(key, key), key)     # an old key: where it went
    if key.startswith("plugins."):             # plugins.<kind>.<name>.<setting>
        _, kind, rest = key.split(".", 2)
        name, _, setting = rest.rpartition(".")
        return cfg.plugins.get(kind, {}).get(name, {}).get(setting)
    section, _, field = key.rpartition(".")
    if not section:
        section, field = FLAT_KEYS[key]
    return getattr(getattr(cfg, section), field) if section else getattr(cfg, field)


FLAGS = table("Command-line flags")


@pytest.mark.parametrize("row", FLAGS, ids=[code(r[0]) for r in FLAGS])
def test_each_flag_row_builds_its_config(row, capsys):
    argv, builds = shlex.split(code(row[0])), row[3]
    if builds == "error":
        with pytest.raises(ConfigError, match=f"^{argv[0]}.*not an fdx setting; "):
            serve_config(argv)
        assert main(["serve", *argv]) == 2                    # the command line's one-line message
        err = capsys.readouterr().err
        assert err.startswith(f"fdx: error: {argv[0]}") and "unrecognized" not in err
        return
    cfg = serve_config(argv)
    if builds == "no-op":
        assert cfg == serve_config([])
        return
    expected = dict(part.split(": ", 1) for part in code(builds).split("; "))
    default = serve_config([])
    for key, value in expected.items():
        want = yaml.safe_load(value)
        assert attr(cfg, key) == want, (row, key)
        assert attr(default, key) != want or key.endswith(("enable_chunked_prefill", "kv_cache")), \
            f"{key}: the row shows the default, so it proves nothing"


def test_the_flag_table_covers_the_aliases_and_refusals_in_the_code():
    from fdx.entrypoints.engine_args import _ALIAS_FLAGS, FOREIGN_FLAGS
    shown = {shlex.split(code(r[0]))[0] for r in FLAGS}
    assert set(FOREIGN_FLAGS) - shown == set()
    assert set(_ALIAS_FLAGS) - {"--task"} - shown == set()


def test_the_issue_command_line_builds_what_it_says():
    cfg = serve_config(shlex.split("M --max-model-len 4096 --max-num-seqs 64 --enable-prefix-caching "
                                   "--tensor-parallel-size 2"))
    assert (cfg.model.model, cfg.model.max_model_len, cfg.scheduler.max_num_seqs, cfg.cache.kv_cache,
            cfg.parallel.tensor_parallel_size) == ("M", 4096, 64, "prefix", 2)
    with pytest.raises(ConfigError, match="two models"):
        serve_config(["a", "--model", "b"])


def test_a_bad_value_names_the_flag_or_key(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--dtype", "int3"])
    assert "--dtype" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="--guided-decoding-backend outlines"):
        serve_config(["--guided-decoding-backend", "outlines"])
    with pytest.raises(ConfigError, match="model.task"):
        serve_config(["--task", "classify"])
    with pytest.raises(ConfigError, match="cache.memory_fraction"):
        serve_config(["--gpu-memory-utilization", "1.5"])


def keyword(text: str) -> tuple[str, object]:
    """``name=value`` as Python would read it."""
    name, value = text.split("=", 1)
    return name, ast.literal_eval(value)


LLM_ROWS = table("`LLM(...)` keywords and config keys")


@pytest.mark.parametrize("row", LLM_ROWS, ids=[code(r[0]).split("=")[0] for r in LLM_ROWS])
def test_each_llm_keyword_row(row):
    """LLM(model, **kw) builds its config with FdxConfig.build(**kw) (core/llm.py)."""
    theirs, ours = row[0], row[2]
    if ours.startswith("none"):
        name, value = keyword(code(theirs))
        with pytest.raises(ConfigError, match=f"unknown config key '{name}'"):
            FdxConfig.build(**{name: value})
        return
    name, value = keyword(code(ours))
    cfg = FdxConfig.build(**{name: value})
    assert attr(cfg, name) == value
    # the keyword changes a setting, in the section the key names (a row showing the default proves nothing)
    default = FdxConfig.build()
    assert attr(default, name) != value, f"{name}: the row shows the default, so it proves nothing"
    changed = {s for s in type(cfg).model_fields if getattr(cfg, s) != getattr(default, s)}
    assert attr_section(name) in changed, (name, changed)


SP_ROWS = table("`SamplingParams`")


@pytest.mark.parametrize("row", SP_ROWS, ids=[code(r[0]).split("=")[0] for r in SP_ROWS])
def test_each_sampling_params_row(row):
    theirs, ours = row[0], row[2]
    if ours.startswith("none"):
        name, value = keyword(code(theirs))
        with pytest.raises(TypeError, match=name):
            SamplingParams(**{name: value})
        return
    name, value = keyword(code(ours))
    sp = SamplingParams(**{name: value})
    assert getattr(sp, name) == value
    assert getattr(SamplingParams(), name) != value, f"{name}: the row shows the default, so it proves nothing"


def metric_rows() -> list[tuple[str, str]]:
    """(theirs, fdx's) for each metric row that names an fdx series."""
    return [(r[0], code(r[1])) for r in table("Metrics") if r[1].startswith("`fdx:")]


def attr_section(key: str) -> str:
    """The config section a flat or dotted key lands in."""
    from fdx.core.config import FLAT_KEYS
    key = DEPRECATED.get(DEPRECATED_FLAT.get(key, key), key)
    if key in FLAT_KEYS:
        section, field = FLAT_KEYS[key]
        return section or field                     # seed: a top-level field
    return key.split(".", 1)[0]


def test_the_metric_table_names_fdx_series():
    rows = metric_rows()
    assert len(rows) >= 15 and all(name.startswith("fdx:") for _, name in rows)


def test_every_config_key_is_documented():
    """configuration.md (the server's also in serving.md's tables) names every config field."""
    import re
    from fdx.core.config import SECTIONS
    docs = DOC.parent
    text = (docs / "configuration.md").read_text() + (docs / "serving.md").read_text()
    missing = [f"{s}.{f}" for s in SECTIONS for f in FdxConfig.model_fields[s].annotation.model_fields
               if not re.search(rf"\b{f}\b", text)]
    assert missing == []


def test_every_command_takes_quiet():
    """README: every command takes --quiet and --log-level."""
    import argparse
    from fdx.entrypoints.cli import _leaf_parsers
    parser = build_parser()
    leaves = list(_leaf_parsers(parser))
    assert len(leaves) >= 14
    for sp in leaves:
        path = sp.prog.split()[1:]
        positionals = ["x" for a in sp._actions if not a.option_strings and a.nargs is None
                       and not isinstance(a, argparse._SubParsersAction)]
        required = [x for a in sp._actions if a.option_strings and a.required for x in (a.option_strings[0], "x")]
        args = parser.parse_args([*path, *positionals, *required, "--quiet"])
        assert args.quiet is True, path
        assert any("--log-level" in a.option_strings for a in sp._actions), path
