"""What each peer does with a valid lane past its cache, measured rather than assumed.

For each built-in peer adapter, this runs the suite test
``test_a_valid_lane_past_the_cache_does_what_the_envelope_says`` (main and extra cache) with the
adapter's envelope switched to ``index_past_cache="masked"``: the test then runs the peer on a row
whose lane 0 of the last token names slot ``num_pages * page_block_size`` and compares the result
with the same row holding ``-1`` there. A pass means the peer masks the lane; a failure's message
says what it did instead (NaN, another value, its own error); a dead CUDA context is reported by the
plugin (``device_health``). Each peer runs in its own pytest process.

    PYTHONPATH=scripts python scripts/past_cache_probe.py [IMPL ...]     # on a CUDA machine

The findings go into each adapter's ``envelope.index_past_cache`` or its xfail file.
"""

from __future__ import annotations

import dataclasses
import subprocess
import sys

from pytest_sparse_mla.implementations import BUILTINS, catalogue

PEERS = catalogue.peer_names()
TEST = "suites/test_attention_inputs.py::test_a_valid_lane_past_the_cache_does_what_the_envelope_says"


def masked(name: str) -> object:
    """The built-in adapter ``name`` (an instance) with ``index_past_cache="masked"``."""
    impl = BUILTINS[name](None)
    impl.envelope = dataclasses.replace(impl.envelope, index_past_cache="masked")
    return impl


def __getattr__(attr: str) -> object:  # past_cache_probe:flashmla etc.
    name = attr.replace("_", "-")
    if name in BUILTINS:
        return masked(name)
    raise AttributeError(attr)


def main(argv: list[str]) -> int:
    for name in argv or PEERS:
        attr = name.replace("-", "_")
        cmd = [sys.executable, "-m", "pytest", "-p", "sparse_mla", TEST, "--sparse-mla-impl",
               f"past_cache_probe:{attr}", "--sparse-mla-require-gpu", "-p", "no:xdist", "-p", "no:cacheprovider",
               "-q", "--tb=line", "-rA", "-W", "ignore"]  # fmt: skip
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        keep = [ln for ln in proc.stdout.splitlines()
                if ln.startswith(("PASSED", "FAILED", "ERROR", "SKIPPED", "E ", "/")) or "CUDA" in ln
                or " passed" in ln or " failed" in ln]  # fmt: skip
        print(f"== {name}: exit {proc.returncode}")
        for line in keep[:30]:
            print("   ", line[:600])
        if proc.returncode not in (0, 1):
            print("   ", proc.stderr[-1500:])
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
