import sys

from tokenwire.cli import main

sys.exit(main())
