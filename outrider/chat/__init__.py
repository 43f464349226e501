"""Chat messages into a model's prompt and its answer back into parts: the chat template
(sandboxed when a request brings its own), thinking and channel markers, text checks. The
Python API and the server both render through here, so a conversation is the same prompt
whichever way it arrives."""
