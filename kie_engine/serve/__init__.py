"""KIE's OpenAI-compatible HTTP server (`python -m kie_engine serve`).

engine_runner: the model, loaded once, run one request at a time (the seam to the engine);
lanes: how tensor-parallel lanes follow rank 0's requests (MPI);
scheduler: the FIFO queue and the thread that runs the engine;
text: detokenized text with stop strings held back;
schemas: request validation into typed requests, OpenAI-shaped errors;
sse, metrics, app: the HTTP side; server: start, serve, shut down."""
