# SPDX-License-Identifier: Apache-2.0
"""The embedded serving engine: requests, scheduler, model runner and the step loop."""
