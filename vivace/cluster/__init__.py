"""Scale-out on Ray Serve: several engine replicas and weighted versions of each served model
behind one OpenAI endpoint (vivace's own app as the ingress), with prefix-aware routing,
queue-depth autoscaling and failure isolation. Imported only when ``vivace serve`` is given
a scale-out flag; the single-process server never imports Ray."""
