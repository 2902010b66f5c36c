"""Running the CLI in-process, and model directories for it."""

from __future__ import annotations

import json

from sample_requests import CONFIGS

from loadplan.cli.main import main


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def model_dir(tmp_path, config, name="model"):
    d = tmp_path / name
    d.mkdir()
    (d / "config.json").write_text(config if isinstance(config, str) else json.dumps(config))
    return str(d)


def real_model(name: str) -> str:
    d = CONFIGS / name
    assert (d / "config.json").is_file(), f"tests/data/configs/{name}/config.json is missing"
    return str(d)
