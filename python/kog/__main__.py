import sys

from kog.cli import main

sys.exit(main())
