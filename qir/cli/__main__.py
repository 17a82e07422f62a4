import sys

from qir.cli import main

sys.exit(main())
