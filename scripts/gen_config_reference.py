#!/usr/bin/env python
"""Write docs/configuration.md from the config schemas (:mod:`otb_tir.config_reference`).

python scripts/gen_config_reference.py            # rewrite docs/configuration.md
python scripts/gen_config_reference.py --check    # exit 1 if it is out of date
"""

import sys

from otb_tir.config_reference import main

if __name__ == "__main__":
    sys.exit(main())
