"""ShadowKV mode: the compressed prompt (low-rank keys, landmarks, outliers, local window, host values), the
temporal cache and the decode step that selects chunks."""
