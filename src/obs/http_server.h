#pragma once
// A small HTTP/1.1 server for the Prometheus /metrics endpoint. One background thread
// multiplexes the listening socket and every open connection with poll(): no request
// can block another or the trainer. Each connection gets one request and one response
// (Connection: close), and is dropped after kConnTimeoutMs without finishing.
//   GET|HEAD <path>   -> the handler's answer (404 for paths it does not know)
//   other methods     -> 405;   unparsable request / oversized header -> 400 / 431
//   handler throws    -> 500 with a fixed body (the exception's text goes to the log,
//                        throttled: never to the peer)
// Anyone who reaches the port is served, so a peer's cost is bounded: kMaxHeaderBytes of
// request, kConnTimeoutMs from accept to the end of the request (idle and trickling peers
// alike), kMaxConnections at once. When they are all taken, a new connection evicts the
// oldest one still reading its request if that one is older than kEvictGraceMs (a flood of
// idle connections cannot lock a scraper out); else the newcomer is closed. Running out of
// file descriptors refuses newcomers (503) instead of spinning.
#include <atomic>
#include <cstdint>
#include <functional>
#include <string>
#include <thread>

#include "core/net_guard.h"

namespace dtrain {

class MetricRegistry;

struct HttpResponse {
  int status = 200;
  std::string content_type = "text/plain; charset=utf-8";
  std::string body;
};

// Called on the server thread with the request path (query string removed).
using HttpHandler = std::function<HttpResponse(const std::string& path)>;

class HttpServer {
 public:
  static constexpr int kConnTimeoutMs = 5000;
  static constexpr size_t kMaxHeaderBytes = 8192;
  static constexpr size_t kMaxConnections = 64;
  static constexpr int kEvictGraceMs = 250;

  // Binds and listens on bind:port (IPv4 or IPv6 literal, or a host name such as
  // "localhost"; port 0 = any free port, see port()) and starts the thread.
  // UserError naming observability.bind / observability.prometheus_port when the
  // address or port cannot be used.
  HttpServer(const std::string& bind, int port, HttpHandler handler);
  ~HttpServer();  // stops the thread and closes every socket
  HttpServer(const HttpServer&) = delete;
  HttpServer& operator=(const HttpServer&) = delete;

  int port() const { return port_; }  // the port actually bound
  const std::string& bind() const { return bind_; }
  uint64_t requests_served() const { return served_.load(); }
  uint64_t handler_errors() const { return handler_errors_.load(); }  // 500s
  uint64_t connections_evicted() const { return evicted_.load(); }
  uint64_t connections_refused() const { return refused_.load(); }  // at the limit, or out of fds

 private:
  void loop();
  std::string bind_;
  int port_ = 0;
  int listen_fd_ = -1;
  int wake_[2] = {-1, -1};  // pipe: a byte written to wake_[1] stops the loop
  HttpHandler handler_;
  net_guard::Acceptor acceptor_;  // opened with the socket, before any peer can use the descriptors up
  std::atomic<uint64_t> served_{0}, handler_errors_{0}, evicted_{0}, refused_{0};
  std::thread thread_;
};

// The /metrics handler: renders the registry's latest snapshot; 404 for other paths.
HttpHandler metrics_handler(const MetricRegistry& reg);

// Parses the request head (everything up to the blank line). Exposed for tests.
// Returns false for a malformed request line.
struct HttpRequestLine {
  std::string method, path, version;
};
bool parse_request_line(const std::string& head, HttpRequestLine& out);

}  // namespace dtrain
