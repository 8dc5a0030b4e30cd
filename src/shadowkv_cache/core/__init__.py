"""Pure tensor maths of the algorithm: low-rank key factors, chunk landmarks and outliers, the attention over a
selected set and its masks. No Transformers, no host memory."""
