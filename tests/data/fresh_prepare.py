"""A preparation in a process of its own (tests/data/test_reproducible_prepare.py starts it).

``python -m tests.data.fresh_prepare CACHE OVERRIDES_JSON``: for each list of ``--set``
overrides in the JSON list, prepare tests/small.py's config into ``CACHE`` (fresh);
print the prepared folders, one a line.
"""

import json
import sys
from pathlib import Path

from data_prep.prepare import prepare_data
from tests.small import small_config


def main(cache: Path, overrides: list[list[str]]) -> None:
    for extra in overrides:
        prepared = prepare_data(small_config(*extra), cache, log=lambda _: None)
        assert not prepared.cached, f"{cache} was not fresh"
        print(prepared.root)


if __name__ == "__main__":
    main(Path(sys.argv[1]), json.loads(sys.argv[2]))
