import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
GOLDEN = os.path.join(ROOT, "golden")
TEO_BIN = os.environ.get("TEO_BIN", os.path.join(ROOT, "build", "teo"))
