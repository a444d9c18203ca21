# SPDX-License-Identifier: Apache-2.0
"""`dflash-trt build`: target name -> validated deployment bundle (see dflash_trt/bundle.py)."""
