import sys

from ernie_deploy.cli import main

sys.exit(main())
