"""A module whose import takes half a minute: a preloader still importing it when the launcher is stopped."""

import time

time.sleep(30)
