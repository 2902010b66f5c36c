"""Print scripts/sglang-env-requirements.txt with the installed SGLang release's own pins.

SGLang is installed with --no-deps (its own requirements pull a CUDA torch and GPU-only wheels); the environment
gets the pure-Python imports its decision code demands on a CPU, listed in scripts/sglang-env-requirements.txt.
Where the release's wheel pins one of them exactly (Requires-Dist `name==X`: transformers and tokenizers move with
SGLang, 0.5.20 and 0.5.21 want transformers 5.12.1), that pin wins, so each release's environment runs the
libraries that release was built against. Run with the release's environment's python.
"""

from importlib.metadata import distribution
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

LISTED = Path(__file__).resolve().parent / "sglang-env-requirements.txt"


def main() -> None:
    pins = {}
    for line in distribution("sglang").requires or []:
        requirement = Requirement(line)
        spec = list(requirement.specifier)
        if len(spec) == 1 and spec[0].operator == "==" and (requirement.marker is None
                                                            or requirement.marker.evaluate({"extra": ""})):
            pins[canonicalize_name(requirement.name)] = spec[0].version
    for line in LISTED.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        requirement = Requirement(line)
        name = canonicalize_name(requirement.name)
        print(f"{requirement.name}=={pins[name]}" if name in pins else line)


if __name__ == "__main__":
    main()
