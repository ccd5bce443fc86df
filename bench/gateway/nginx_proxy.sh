# Sourced by the gateway benchmarks: nginx configs, one process (master_process off: its CPU is
# all in the one pid the scripts read). A keep-alive reverse proxy is the floor for what two
# loopback hops cost in a lean C event loop; a static answer the floor for an HTTP server alone.
#
#   nginx_proxy_conf DIR LISTEN_PORT UPSTREAM_PORT [LOCATION_DIRECTIVES]
#
# LOCATION_DIRECTIVES go into the proxied location (e.g. "proxy_buffering off;" for streams).
#
#   nginx_static_conf DIR LISTEN_PORT BODY
#
# nginx answering every request 200 with BODY from its config: the floor of an HTTP server alone.
nginx_static_conf() {
    cat <<EOF
worker_processes 1; master_process off; pid $1/static.pid; error_log $1/static-error.log warn;
events { worker_connections 4096; }
http { access_log off; keepalive_requests 1000000; server { listen 127.0.0.1:$2; location / { return 200 '$3'; } } }
EOF
}

nginx_proxy_conf() {
    cat <<EOF
worker_processes 1; master_process off; pid $1/proxy.pid; error_log $1/proxy-error.log warn;
events { worker_connections 4096; }
http {
    access_log off; keepalive_requests 1000000; keepalive_timeout 300s;
    upstream w { server 127.0.0.1:$3; keepalive 64; }
    server {
        listen 127.0.0.1:$2;
        location / { proxy_pass http://w; proxy_http_version 1.1; proxy_set_header Connection ""; ${4:-} }
    }
}
EOF
}
