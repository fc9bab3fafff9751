"""Imported first by every job script: quiet TensorFlow's C++ log, and run this checkout's own `app`.

`ray job submit --working-dir .` ships the code next to the scripts, so the
checkout's package must win over an installed copy.
"""

import os
import sys
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # TensorFlow's C++ INFO/WARNING chatter
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from app import tf_import
from app.ui import console

tf_import.install()  # the INFO lines TF_CPP_MIN_LOG_LEVEL does not stop (see there)
console.for_this_process()  # the console stays for people until the script ends
