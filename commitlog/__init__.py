
from nsqwire._compiled import use_compiled

use_compiled(__path__, __name__)  # scripts/compile.py: the compiled hot path, if built
