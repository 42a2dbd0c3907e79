import sys

from sandpool.cli import main

sys.exit(main())
