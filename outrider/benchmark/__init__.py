"""`outrider benchmark`: every mode and mlx-lm's own generation on the same prompts, checked
token for token against plain decoding, timed, and written up as a device-stamped receipt."""
