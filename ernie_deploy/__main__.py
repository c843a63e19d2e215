import sys

from ernie_deploy.cli.main import main

sys.exit(main())
