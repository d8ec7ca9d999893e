"""The NSQ wire protocol, sans-I/O: message ids, names, the command parser, frame
encoders and every E_* error. Ground level: it imports nothing of ours."""

from ._compiled import use_compiled

use_compiled(__path__, __name__)  # scripts/compile.py: the compiled hot path, if built
