"""YAKV mode: the quantised prompt (~4-bit keys and values on the host, a ~2-bit scoring copy on the device) and
the decode step that selects tokens."""
