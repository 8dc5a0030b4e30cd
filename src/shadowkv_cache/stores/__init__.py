"""Where the offloaded state lives: host stores of values and quantised records, their codecs, the pinned-memory
pool, and the device buffer of tokens after the prompt."""
