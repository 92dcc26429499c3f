"""Ray Serve's pieces of the OpenAI server (launch/ray_serve.py builds the application):
its arguments, the ingress, the engine replicas and the prefix-aware request router."""
