"""`python -m kv_manager_service.cli`: the `kv-manager` command."""

import sys

from kv_manager_service.cli.main import main

sys.exit(main())
