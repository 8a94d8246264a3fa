#include "backend/stream.h"

namespace dtrain {

Stream::Stream(std::string name, std::shared_ptr<StreamChecker> checker)
    : name_(std::move(name)), checker_(std::move(checker)) {
  if (checker_) id_ = checker_->add_stream(name_);
}

void Stream::wait_for(Stream& producer) {
  do_wait_for(producer);
  if (checker_ && producer.checker_ == checker_) checker_->wait_stream(id_, producer.id_);
}

void Stream::synchronize() {
  do_synchronize();
  if (checker_) checker_->host_wait_stream(id_);
}

StreamMark Stream::issue(const std::string& op, const std::vector<MemAccess>& acc) {
  if (!checker_) return {};
  return StreamMark{checker_, checker_->issue(id_, op, acc)};
}

}  // namespace dtrain
