# SPDX-License-Identifier: Apache-2.0
from dflash_trt.cli import main

main()
