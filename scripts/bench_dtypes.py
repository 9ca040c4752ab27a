"""float32 vs bfloat16, stock vs flexpage, on this CPU's tier: ``flexpage bench dtypes`` as a file, same options (code: flexpage/bench/dtypes.py)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's flexpage, installed or not

from flexpage.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(["bench", "dtypes", *sys.argv[1:]]))
